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

**Started from k-means++** (``library.kmeans_init``, the default; ``random``: FAISS' random tags). The chosen k's fit
starts from scikit-learn's k-means++ seeding (centroids drawn apart, each with odds by its distance to those already
drawn) on the fit's sample. From random tags, k-means ends in a poorer optimum at k = 1,000, and more iterations do
not climb out of it: on the dev corpus the weighted mean cosine of a tag to its centroid is 0.688 from random starts
(0.688 with 60 iterations instead of 20) and 0.710 from k-means++, two seeds' partitions agree at an adjusted Rand
index of 0.35 and 0.46, and the concepts are more topical (README, "The concept library"). It costs 40 s there on 2
CPU cores (the fit itself 13 s), and grows as k x the sample; the sweep's fits start at random, as they only rank the
k's.

**Tags placed by their chunks too** (``library.context_weight``, 0.4 by default; 0: the tag embeddings alone). A tag's
embedding says what its words mean, not what the texts it was given to are about: "afp" sat with "type ub" and "ulm",
"strip" with "reel" and "nl wrap", a company's name with other names rather than with its business. So the chosen k
is fit on each tag's embedding joined with its *context*: the mean embedding (``annotator.encoder``, through the run's
embedding cache, which the coherence test and the annotator read again) of up to ``CONTEXT_SAMPLE`` of its chunks,
the two parts weighted so that cosine in the joined space is ``1 - w`` times the tags' cosine plus ``w`` times their
contexts'. The sweep still scores the tags' own embeddings (in the joined space silhouette is best at k = 200, and
chose 500: coarser concepts). The coherence stage's tag-set test reads the joined vectors (``_vectors.npy``), with
its null drawn from them, so a cluster is judged in the space it was made in; judged on the tags alone, topics whose
tags are not alike as strings fail ("cup, hart trophy, louis arena, playoff win": the Detroit Red Wings) and 41% of
the clusters were dropped. The centroids and similarities written are the tag embeddings' own (each cluster's
occurrence-weighted mean tag), which names read. Each tag's cosine to its cluster's centroid in the joined space
(``joined_similarity``; the centroids: ``_joined_centroids.npy``) is written too: a tag inherits its cluster's concept
when either cosine reaches its floor (``library.tag_min_similarity``, ``library.joined_min_similarity``), and its near
concept is found in the joined space (library stage). What it changed on the dev corpus and on other documents of its
sources is in README, "The concept library", and docs/quality.md.

    clusters/part-00000.parquet   tag_norm, cluster_id, similarity (to its centroid), count, joined_similarity (to
                                  its centroid in the space k-means fit; null without contexts)
    clusters/_centroids.npy       float32 [k, d]: each cluster's mean tag embedding
    clusters/_vectors.npy         float16 [tags, d + d_chunk]: what k-means fit, the tags joined with their contexts
                                  (only with library.context_weight > 0)
    clusters/_joined_centroids.npy  float32 [k, d + d_chunk]: each cluster's mean joined vector (likewise)
    clusters/_sweep.json          one row per k: silhouette, davies_bouldin, cohesion, seconds
    report/k_sweep.png
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from atlas.core.files import atomic_write_json, atomic_write_npy, atomic_write_parquet
from atlas.core.rundir import RunDir
from atlas.core.stage import Stage
from atlas.core.stats import Stats
from atlas.io import layout
from atlas.io.outofcore import LIST_BUDGET, budget_slices, duckdb_session, scratch
from atlas.io.tags import float_rows, load_vocab
from atlas.models.embedder import Embedder, embed_chunks

CLUSTER_VERSION = 3  # 2: tags placed by their chunks too (library.context_weight); 3: joined_similarity
CONTEXT_SAMPLE = 32  # chunks whose mean embedding is a tag's context (evenly spaced over its sorted chunk ids)
CONTEXT_TAGS_PER_PASS = 8192  # tags whose context samples are held at a time (at most 32 chunk ids each)
BLOCK_ROWS = 65536  # tag rows averaged at a time for the centroids
CLUSTER_SCHEMA = pa.schema(
    [("tag_norm", pa.string()), ("cluster_id", pa.int64()), ("similarity", pa.float32()), ("count", pa.int64()),
     ("joined_similarity", pa.float32())]
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
        context = {"context_weight": c.context_weight, "context_encoder": self.config.annotator.encoder,
                   "context_sample": CONTEXT_SAMPLE} if c.context_weight > 0 else {}
        return {"version": CLUSTER_VERSION, "seed": c.seed, "ks": c.ks, "k": c.k, "k_tolerance": c.k_tolerance,
                "sweep_seeds": c.sweep_seeds, "weights": c.cluster_weights, "init": c.kmeans_init} | context

    def setup(self) -> None:
        self.chunk_encoder = Embedder(self.config.annotator.encoder)  # loaded only if a chunk is not in the cache

    def run_shard(self, run: RunDir, shard: int) -> Stats:
        tmp = run.output_dir(layout.TMP) / self.name  # the joined vectors are built here, then moved to the output
        with scratch(tmp):
            return self._cluster(run, tmp)

    def _cluster(self, run: RunDir, tmp: Path) -> Stats:
        from atlas.models.kmeans import assign, cluster_quality, k_grid, kmeans

        c = self.config.library
        vocab, tag_vectors = load_vocab(run, ["tag_norm", "count"])  # float16 on disk; k-means reads a sample
        stats = Stats({"tags_in": len(tag_vectors)})
        x = tag_vectors  # the sweep scores the tags' own embeddings; the chosen k is fit with their contexts
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
        with_contexts = c.context_weight > 0
        if with_contexts:
            x = self._joined(run, tag_vectors, tmp, stats)
        centroids = kmeans(x, chosen, seed=c.seed, weights=weights, init=c.kmeans_init)  # refit the chosen k
        labels, similarity = assign(x, centroids)
        joined_similarity = None  # without contexts there is one space: null
        if with_contexts:  # names read the tags' own space; the similarity floors and near concepts both (docstring)
            joined_centroids, joined_similarity = tag_centroids(x, labels, len(centroids), weights)
            centroids, similarity = tag_centroids(tag_vectors, labels, len(centroids), weights)
        stats.inc("k", len(centroids))
        stats.inc("clusters_non_empty", len(np.unique(labels)))

        table = pa.table({"tag_norm": vocab.column("tag_norm"), "cluster_id": labels.astype(np.int64),
                          "similarity": similarity.astype(np.float32), "count": vocab.column("count"),
                          "joined_similarity": pa.nulls(len(labels), pa.float32()) if joined_similarity is None
                          else joined_similarity.astype(np.float32)}, schema=CLUSTER_SCHEMA)
        folder = run.output_dir(self.output)
        vectors, joined = folder / layout.CLUSTER_VECTORS, folder / layout.CLUSTER_JOINED_CENTROIDS
        if with_contexts:  # the coherence test judges the clusters in the space they were made in
            folder.mkdir(parents=True, exist_ok=True)
            os.replace(tmp / "joined.npy", vectors)  # one file system: the rename is atomic
            atomic_write_npy(joined, joined_centroids.astype(np.float32))
        else:  # the files of an earlier fit with contexts would be read instead
            vectors.unlink(missing_ok=True)
            joined.unlink(missing_ok=True)
        atomic_write_parquet(run.part_path(self.output, 0), table)
        atomic_write_npy(folder / layout.CLUSTER_CENTROIDS, centroids.astype(np.float32))
        atomic_write_json(folder / "_sweep.json",
                          {"chosen_k": chosen, "final_fit_weights": c.cluster_weights, "final_fit_init": c.kmeans_init,
                           "context_weight": c.context_weight, "sweep": sweep})
        self._plot(run, sweep, chosen)
        return stats

    def _joined(self, run: RunDir, tag_vectors: np.ndarray, tmp: Path, stats: Stats) -> np.ndarray:
        """Each tag's embedding joined with its context (see the module docstring), float16 rows of unit length in a
        memory-mapped file of ``tmp``: one block of tags, and the chunks of their samples, in memory at a time."""
        from tqdm.auto import tqdm  # a bar inside the stage's one shard: embedding the chunks is its long step

        from atlas.models.kmeans import join_context

        w = self.config.library.context_weight
        part = pq.ParquetFile(run.part_path(layout.TAG_VOCAB, 0))
        n = len(tag_vectors)
        joined = None
        done = missing = 0
        with (duckdb_session(tmp, self.config.execution.memory_gb) as con,
              tqdm(total=n, desc="cluster: tag contexts", unit="tag",
                   disable=not self.config.execution.progress) as bar):
            for batch in part.iter_batches(batch_size=CONTEXT_TAGS_PER_PASS, columns=["chunk_ids"]):
                samples = [spread(ids, CONTEXT_SAMPLE) for ids in batch.column("chunk_ids").to_pylist()]
                for block in budget_slices(np.asarray([len(s) for s in samples]), LIST_BUDGET):
                    ids = sorted({chunk for s in samples[block] for chunk in s})
                    vectors, computed = embed_chunks(con, run, ids, self.chunk_encoder,
                                                     self.config.annotator.embed_batch_size)
                    stats.inc("context_chunks_embedded", computed)
                    row = {chunk: i for i, chunk in enumerate(ids)}
                    context = np.zeros((block.stop - block.start, vectors.shape[1]), dtype=np.float32)
                    for j, sample in enumerate(samples[block]):
                        if sample:
                            context[j] = vectors[[row[chunk] for chunk in sample]].astype(np.float32).mean(axis=0)
                    missing += int((~context.any(axis=1)).sum())
                    tags = float_rows(tag_vectors, np.arange(done, done + len(context)))
                    if joined is None:
                        joined = np.lib.format.open_memmap(tmp / "joined.npy", mode="w+", dtype=np.float16,
                                                           shape=(n, tags.shape[1] + context.shape[1]))
                    joined[done:done + len(context)] = join_context(tags, context, w)
                    done += len(context)
                    bar.update(len(context))
        stats.inc("tags_without_context", missing)
        joined.flush()
        return joined

    @staticmethod
    def _plot(run: RunDir, sweep: list[dict], chosen: int) -> None:
        from atlas.core.plots import lines

        ks = [row["k"] for row in sweep]
        series = {name: [row[name] for row in sweep] for name in ("silhouette", "davies_bouldin", "cohesion")}
        lines(ks, series, run.root / layout.REPORT / "k_sweep.png", f"k-sweep (chosen k = {chosen})", "k")


def spread(ids: list[str], n: int) -> list[str]:
    """At most ``n`` of ``ids``, evenly spaced over the list (a tag's chunk ids are sorted: its sample spans the
    corpus' shards rather than taking the first)."""
    if len(ids) <= n:
        return ids
    return [ids[i] for i in np.linspace(0, len(ids) - 1, n).round().astype(int)]


def tag_centroids(tag_vectors: np.ndarray, labels: np.ndarray, k: int,
                  weights: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Each cluster's (weighted) mean row of ``tag_vectors`` (the tags' embeddings, or their joined vectors), of unit
    length, and each tag's cosine to its cluster's."""
    from atlas.models.kmeans import normalize_rows

    sums = np.zeros((k, tag_vectors.shape[1]), dtype=np.float64)
    for start in range(0, len(labels), BLOCK_ROWS):
        rows = float_rows(tag_vectors, np.arange(start, min(start + BLOCK_ROWS, len(labels))))
        w = np.ones(len(rows)) if weights is None else weights[start:start + len(rows)]
        np.add.at(sums, labels[start:start + len(rows)], rows * w[:, None])
    centroids = normalize_rows(sums)
    similarity = np.empty(len(labels), dtype=np.float32)
    for start in range(0, len(labels), BLOCK_ROWS):
        rows = normalize_rows(float_rows(tag_vectors, np.arange(start, min(start + BLOCK_ROWS, len(labels)))))
        similarity[start:start + len(rows)] = (rows * centroids[labels[start:start + len(rows)]]).sum(axis=1)
    return centroids, similarity
