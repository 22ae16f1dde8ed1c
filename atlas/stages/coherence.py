"""Stage ``coherence`` (global): drop incoherent clusters (paper 4.2.2).

Each cluster is judged on three strata of ``library.strata_size`` tags (10 in the paper): its
core (closest to the centroid), a random sample and its edge (farthest). Each set gets a score
from 1 to 10, from the LLM judge (``prompts/judge_coherence.yaml``) or, with the offline engine,
from its embedding cohesion: the mean pairwise cosine of the set's tags, mapped linearly from
[COHESION_LOW, COHESION_HIGH] onto 1-10. The bounds were set on MiniLM tags of the dev corpus
(k = 500), where the filter then drops a fifth of the clusters, as the paper's did (21%); edge
sets of large clusters are loose, so the drop rate depends on k (1% of the demo's 500 small clusters).
A cluster is kept when core >= 9, random >= 8 and edge >= 7 (``library.core_min`` etc.). A cluster of one tag is
trivially coherent (10). Dropped clusters go to ``coherence/_rejects/`` with their scores.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from atlas.config import PROJECT_ROOT
from atlas.core.extras import llm_extras
from atlas.core.files import atomic_write_parquet
from atlas.core.rundir import RunDir
from atlas.core.stage import Stage
from atlas.core.stats import Stats
from atlas.io import layout
from atlas.io.tags import load_vocab
from atlas.llm.engine import LLMRequest, make_engine, setup_engine
from atlas.llm.prompts import load_prompt

COHERENCE_VERSION = 1
COHESION_LOW, COHESION_HIGH = -0.125, 0.375  # offline: mean pairwise cosine -> score 1 .. 10 (see above)
STRATA = ("core", "random", "edge")
COHERENCE_SCHEMA = pa.schema(
    [("cluster_id", pa.int64()), ("size", pa.int64()), ("count", pa.int64()), ("core_score", pa.int8()),
     ("random_score", pa.int8()), ("edge_score", pa.int8()), ("kept", pa.bool_()), ("reason", pa.string())]
)
SCORE_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["score"],
                "properties": {"score": {"type": "integer", "minimum": 1, "maximum": 10}}}


def cohesion_score(vectors: np.ndarray) -> int:
    """Mean pairwise cosine of L2-normalized vectors, on the 1-10 scale."""
    if len(vectors) < 2:
        return 10
    sims = vectors @ vectors.T
    mean = (sims.sum() - np.trace(sims)) / (len(vectors) * (len(vectors) - 1))
    return int(np.clip(round(1 + 9 * (mean - COHESION_LOW) / (COHESION_HIGH - COHESION_LOW)), 1, 10))


def strata(members: np.ndarray, similarity: np.ndarray, size: int, rng: np.random.Generator) -> dict:
    """Indices of the core, random and edge sets of one cluster (all the same when it is small)."""
    order = members[np.argsort(-similarity[members], kind="stable")]
    if len(order) <= size:
        return {name: order for name in STRATA}
    return {"core": order[:size], "random": np.sort(rng.choice(order, size, replace=False)), "edge": order[-size:]}


def coherence_prompt():
    return load_prompt(PROJECT_ROOT / "prompts" / "judge_coherence.yaml", {"system": set(), "user": {"tags"}})


class CoherenceStage(Stage):
    name = "coherence"
    output = layout.COHERENCE
    upstream = ("cluster",)
    needs = ("library",)

    def extras(self) -> tuple[str, ...]:
        return self.needs + llm_extras(self.config.llm.engine)

    def identity(self) -> dict:
        c = self.config.library
        identity = {"version": COHERENCE_VERSION, "seed": c.seed, "strata_size": c.strata_size,
                    "thresholds": [c.core_min, c.random_min, c.edge_min]}
        if self.config.llm.engine == "offline":
            return identity | {"offline_cohesion_bounds": [COHESION_LOW, COHESION_HIGH]}
        engine = make_engine(self.config.llm).identity()
        return identity | {"engine": engine, "prompt_sha256": coherence_prompt().sha256}

    def setup(self) -> None:
        self.prompt = coherence_prompt()
        self.engine = setup_engine(self.config.llm)  # None offline: embedding cohesion

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.close()

    def run_shard(self, run: RunDir, shard: int) -> Stats:
        c = self.config.library
        vocab, vectors = load_vocab(run)
        clusters = pq.read_table(run.part_path(layout.CLUSTERS, 0)).to_pydict()
        x = vectors.astype(np.float32)
        labels = np.asarray(clusters["cluster_id"])
        similarity = np.asarray(clusters["similarity"])
        counts = np.asarray(clusters["count"])
        tags = clusters["tag_norm"]
        sets = {}  # (cluster, stratum) -> tag indices
        for cluster in np.unique(labels).tolist():
            members = np.flatnonzero(labels == cluster)
            rng = np.random.default_rng([c.seed, cluster])
            for stratum, indices in strata(members, similarity, c.strata_size, rng).items():
                sets[(cluster, stratum)] = indices
        scores = self._score(sets, x, tags)

        rows, stats = [], Stats({"clusters_in": len(np.unique(labels))})
        for cluster in np.unique(labels).tolist():
            members = np.flatnonzero(labels == cluster)
            core, rand, edge = (scores.get((cluster, s)) for s in STRATA)
            if None in (core, rand, edge):
                kept, reason = False, "judge_failed"
            else:
                failed = [f"{s}={v}<{m}" for s, v, m in zip(STRATA, (core, rand, edge),
                                                             (c.core_min, c.random_min, c.edge_min)) if v < m]
                kept, reason = not failed, "; ".join(failed) or "kept"
            rows.append({"cluster_id": cluster, "size": len(members), "count": int(counts[members].sum()),
                         "core_score": core, "random_score": rand, "edge_score": edge, "kept": kept,
                         "reason": reason})
            stats.inc("clusters_kept" if kept else "clusters_dropped")
            if not kept:
                stats.drop("judge_failed" if reason == "judge_failed" else "incoherent")
        atomic_write_parquet(run.part_path(self.output, 0), pa.Table.from_pylist(rows, schema=COHERENCE_SCHEMA))
        run.write_rejects(self.output, 0, [r for r in rows if not r["kept"]], COHERENCE_SCHEMA)
        self._plot(run, rows)
        return stats

    def _score(self, sets: dict, x: np.ndarray, tags: list[str]) -> dict:
        if self.engine is None:
            return {key: cohesion_score(x[indices]) for key, indices in sets.items()}
        prompt, keys = self.prompt, list(sets)
        requests = [LLMRequest(key=f"{cluster}:{stratum}", system=prompt.templates["system"],
                               user=prompt.render("user",
                                                  tags="\n".join(f"- {tags[i]}" for i in sets[(cluster, stratum)])),
                               schema=SCORE_SCHEMA, schema_name="coherence")
                    for cluster, stratum in keys]
        scores = {}
        for key, result in zip(keys, self.engine.generate(requests)):
            try:
                score = int(json.loads(result.text or "")["score"])
            except (ValueError, KeyError, TypeError):
                continue
            if 1 <= score <= 10:
                scores[key] = score
        return scores

    @staticmethod
    def _plot(run: RunDir, rows: list[dict]) -> None:
        from atlas.core.plots import histogram

        for stratum in STRATA:
            values = [r[f"{stratum}_score"] for r in rows if r[f"{stratum}_score"] is not None]
            histogram(values, run.root / layout.REPORT / f"coherence_{stratum}.png",
                      f"coherence scores, {stratum} sets", "score (1-10)", bins=np.arange(0.5, 11, 1))
