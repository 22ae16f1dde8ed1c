"""Stage ``cluster`` (global): tag embeddings -> clusters, with a k-sweep (paper 4.2.2).

For every k of the sweep (``library.ks``, or a grid from the vocabulary size) the tags are
clustered with spherical FAISS k-means (trained on a FAISS subsample of 256 points per centroid,
then every tag is assigned) and scored: silhouette (cosine, sampled), Davies-Bouldin, and
cohesion (mean cosine of a tag to its centroid), each the mean over ``library.sweep_seeds`` k-means runs. The
chosen k is ``library.k`` when set, else the largest k whose silhouette is within ``library.k_tolerance`` (10%)
of the best (``choose_k``).
Silhouette rewards clusters that are both tight and apart, which is what a concept needs; cohesion
alone always grows with k. Of two k about as well separated the finer one is kept, as the paper
chose a fine k (80,000, where LLM coherence plateaus; not reproducible without an LLM): on the dev
corpus libraries of 300-500 concepts were less topical than 1,000 (top-concept homogeneity against
k-means at the same k 0.62-0.99 vs 0.96-1.03), and with all-mpnet-base-v2 tags the silhouette of
k = 500 and 1,000 differed by 1% to 8% with the seed of one k-means run (mean of seeds 0-2: 3%; of seeds 2-4:
5%): a 5% tolerance chose 500 for some seeds and a library of 334 concepts whose inherited concepts read code
folders at 0.71 of the raw embedding's probe, against 0.82 at 1,000. Hence several runs per k and 10%.

**Occurrences, not distinct tags** (``library.cluster_weights: occurrences``, the default). The sweep reads the
shape of the vocabulary: it fits and scores the distinct tags, each once. The chosen k is then fit with every tag
weighted by how often it was produced, as if k-means clustered the tag occurrences: centroids go where the corpus'
tags are, not where its long tail of one-off variants is. On the dev corpus the unweighted fit put "equation" (55
occurrences), "polynomial" (30), "factor" and "quadratic" in one cluster with 35 rare variants, and it became the
top concept of 71 MATH documents of four subjects; weighted, "equation", "polynomial" and "root" are three concepts
(41, 22 and 19 documents), and top-concept homogeneity rose to k-means' level on code and MATH (see README, "The
concept library"). The sweep itself stays unweighted: scored with the weighted fits, silhouette prefers k = 500
(0.078, against 0.073 at 1,000), and 500 weighted concepts were less topical than 1,000 (homogeneity 0.91 and
0.89 of k-means on code and MATH).

    clusters/part-00000.parquet   tag_norm, cluster_id, similarity (to its centroid), count
    clusters/_centroids.npy       float32 [k, d]
    clusters/_sweep.json          one row per k: silhouette, davies_bouldin, cohesion, seconds
    report/k_sweep.png
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from atlas.core.files import atomic_write_json, atomic_write_npy, atomic_write_parquet
from atlas.core.rundir import RunDir
from atlas.core.stage import Stage
from atlas.core.stats import Stats
from atlas.io import layout
from atlas.io.tags import load_vocab

CLUSTER_VERSION = 1
CLUSTER_SCHEMA = pa.schema(
    [("tag_norm", pa.string()), ("cluster_id", pa.int64()), ("similarity", pa.float32()), ("count", pa.int64())]
)


def choose_k(sweep: list[dict], tolerance: float = 0.0) -> int:
    """The largest k whose silhouette is at least (1 - tolerance) x the best one; with tolerance 0, the best
    silhouette, ties broken by lower Davies-Bouldin, then smaller k (NaN scores rank last)."""
    def key(row):
        silhouette = row["silhouette"] if np.isfinite(row["silhouette"]) else -np.inf
        davies_bouldin = row["davies_bouldin"] if np.isfinite(row["davies_bouldin"]) else np.inf
        return (-round(silhouette, 4), round(davies_bouldin, 4), row["k"])
    best = min(sweep, key=key)
    if tolerance <= 0 or not np.isfinite(best["silhouette"]) or best["silhouette"] <= 0:
        return best["k"]
    floor = (1 - tolerance) * best["silhouette"]
    return max(row["k"] for row in sweep if np.isfinite(row["silhouette"]) and row["silhouette"] >= floor)


class ClusterStage(Stage):
    name = "cluster"
    output = layout.CLUSTERS
    upstream = ("vocab",)
    needs = ("library",)

    def identity(self) -> dict:
        c = self.config.library
        return {"version": CLUSTER_VERSION, "seed": c.seed, "ks": c.ks, "k": c.k, "k_tolerance": c.k_tolerance,
                "sweep_seeds": c.sweep_seeds, "weights": c.cluster_weights}

    def run_shard(self, run: RunDir, shard: int) -> Stats:
        from atlas.models.kmeans import assign, cluster_quality, k_grid, kmeans

        c = self.config.library
        vocab, x = load_vocab(run, ["tag_norm", "count"])  # x: float16 on disk; k-means reads a sample of it
        stats = Stats({"tags_in": len(x)})
        # the sweep scores distinct tags; the chosen k is fit to the occurrences (see the module docstring)
        weights = (np.maximum(vocab.column("count").to_numpy(), 1).astype(np.float32)
                   if c.cluster_weights == "occurrences" else None)
        grid = [c.k] if c.k else k_grid(len(x), c.ks)
        if not grid:
            raise ValueError(f"{len(x)} tags are too few to cluster (need at least 3); tag more chunks")
        # several k-means runs per k only when their mean chooses k: a fixed library.k is scored once, for the report
        seeds = range(c.seed, c.seed + (1 if c.k else c.sweep_seeds))
        sweep = []
        for k in grid:
            start = time.perf_counter()
            runs = []  # one k-means run's scores per seed: their mean decides (library.sweep_seeds)
            for seed in seeds:
                centroids = kmeans(x, k, seed=seed)
                labels, similarity = assign(x, centroids)
                runs.append(cluster_quality(x, labels, seed=seed) | {"cohesion": float(similarity.mean())})
            row = {"k": len(centroids), **{name: float(np.mean([r[name] for r in runs])) for name in runs[0]},
                   "silhouette_seeds": [r["silhouette"] for r in runs],
                   "seconds": round(time.perf_counter() - start, 3)}
            sweep.append(row)
        chosen = c.k or choose_k(sweep, c.k_tolerance)
        centroids = kmeans(x, chosen, seed=c.seed, weights=weights)  # refit the chosen k
        labels, similarity = assign(x, centroids)
        stats.inc("k", len(centroids))
        stats.inc("clusters_non_empty", len(np.unique(labels)))

        table = pa.table({"tag_norm": vocab.column("tag_norm"), "cluster_id": labels.astype(np.int64),
                          "similarity": similarity.astype(np.float32), "count": vocab.column("count")},
                         schema=CLUSTER_SCHEMA)
        atomic_write_parquet(run.part_path(self.output, 0), table)
        atomic_write_npy(run.output_dir(self.output) / "_centroids.npy", centroids.astype(np.float32))
        atomic_write_json(run.output_dir(self.output) / "_sweep.json",
                          {"chosen_k": chosen, "final_fit_weights": c.cluster_weights, "sweep": sweep})
        self._plot(run, sweep, chosen)
        return stats

    @staticmethod
    def _plot(run: RunDir, sweep: list[dict], chosen: int) -> None:
        from atlas.core.plots import lines

        ks = [row["k"] for row in sweep]
        series = {name: [row[name] for row in sweep] for name in ("silhouette", "davies_bouldin", "cohesion")}
        lines(ks, series, run.root / layout.REPORT / "k_sweep.png", f"k-sweep (chosen k = {chosen})", "k")
