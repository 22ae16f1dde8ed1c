"""Stage ``coherence`` (global): drop incoherent clusters (paper 4.2.2).

**Tag sets.** Each cluster is judged on three strata of ``library.strata_size`` tags (10 in the
paper): its core (closest to the centroid), a random sample and its edge (farthest). Each set gets a
score from 1 to 10, from the LLM judge (``prompts/judge_coherence.yaml``) or, with the offline
engine, from a test against a real null: the set's mean pairwise cosine is compared with that of
``NULL_SETS`` random tag sets of the same size drawn from the vocabulary (seeded). z is the
distance from their mean in standard deviations of a full-size (``strata_size``) random set, so a
small cluster's set needs the same effect as a full one, and is mapped onto 1-10 by the
piecewise-linear ``OFFLINE_SCORE_CURVE``: a random set (z = 0) scores 1, z = 3 scores 6.5,
z = 12 scores 8.5, z >= 18.75 scores 10. With the paper's thresholds a cluster is then kept when
its core set has z >= 12, its random set z >= 7.5 and its edge set z >= 3. These points were set
by reading dev-corpus clusters (k = 500, MiniLM tags): random sets below z = 7.5 read as junk
("negative, although, help, hey"; "msg sensitivity, segt, gbf, groff"), edge sets below z = 3 as
unrelated strings.

The vectors are those k-means fit: with ``library.context_weight`` > 0 (the default) each tag's embedding joined with
the mean embedding of its chunks (``clusters/_vectors.npy``, see ``atlas/stages/cluster.py``), and the null's random
sets are drawn from the same vectors. A cluster of tags given to the same texts is then coherent though its tags are
not alike as strings ("mets, baseball, inning, world series"). Clusters made so hold chunks that are alike, and the
chunk tests below drop fewer of them: on the dev corpus (seed 0) these tests drop 4.8% of the clusters (the tag-set
test 12, the chunk test 33, the cross-tag test 24; a cluster can fail several), where with the tag embeddings alone
they dropped 17.7% (24, 139, 137); with the chunks-covered test below, 9.9%. Read by hand, the kept concepts hold
about as much junk as before (README, "The concept library"): the look-alike strings the chunk tests dropped are no
longer clustered together. On a corpus of one domain the contexts are alike and set the null high: the demo's (Python
documentation) dropped 105 of 200 clusters, good ones among them, against 69 on the tag embeddings alone;
``configs/demo.yaml`` sets the weight to 0.

**Chunks** (every engine). Tags can be alike and still say nothing: a cluster of filler words
("way, right, better, possible") covers chunks that have nothing in common. With m the mean
pairwise cosine of a cluster's chunks (up to ``COHESION_SAMPLE`` of them, seeded, embedded with the annotator's
encoder ``annotator.encoder``, which embeds every chunk for the annotator anyway: a larger tag embedder such as
all-mpnet-base-v2 then costs the tags only) and r that of random chunks of the corpus, the excess cohesion
(m - r) / (1 - r), the share of the way from random chunks to identical ones, must be at least
``library.min_chunk_cohesion`` (0.05; 0 turns the test off). Measured as a share of what is left
above r, it holds for a corpus of one narrow domain (r high) as for a mixed one. On the dev corpus
(k = 1000) clusters below 0.05 read as filler or names ("thing": 0.035, "solution": 0.046, "men":
0.052 with "bipartite bfs" in it, "kent": 0.057 is kept), "error" has 0.21, "lutherans" 0.35.

**Across tags** (every engine). Tags that only look alike to the embedder ("strip", "nl wrap", "reel"; "san", "sin",
"saint") or one word in two senses ("gate": logic gates and wrought-iron gates) each bring chunks that cohere among
themselves, so the cluster's chunks pass the test above (0.26 for "strip") though the tags have nothing in common. The
same excess cohesion over the pairs of sampled chunks that share none of the cluster's tags must reach
``library.min_cross_tag_cohesion`` (0.035; 0 turns the test off). On the dev corpus (k = 1000) it drops 23 clusters
the chunk test kept, 15 of them junk by reading ("right": yeah, oh yeah, uh huh; "certitude": celsius, ieee,
certificate; "strip"), 7 mixed or vague ("gate", "reuters", "value", "system") and one fair ("century": decade, epoch,
era). With both chunk tests and the tag-set test the stage drops 17.7% of the clusters (the paper's LLM judge: 21%).

**Chunks covered** (every engine). A concept must be on at least ``library.min_concept_chunks`` (5) distinct chunks
(``n_chunks``: those of the cluster's tags that will inherit its concept: at ``library.tag_min_similarity`` or more
to its centroid, or at ``library.joined_min_similarity`` in the space k-means fit; see the library stage). With
contexts, the tags of one chunk share its embedding as their context and cluster together: on the dev corpus (seed
0) 51 of the 951 content concepts were on fewer than 5 chunks, and they read as the tags of a chunk or two, not as
something the corpus has ("expert colonel"; "mort": mort sahl, american mein kampf, angry
volume; "casino": fist pump, important thing, monopoly money); the annotator would have a handful of chunks to learn
each from. A concept of one long document stays ("tqdm" in the demo: 16 chunks of its README).

A cluster is kept when core >= 9, random >= 8 and edge >= 7 (``library.core_min`` etc.). A cluster of one tag is
trivially coherent (10). Dropped clusters go to ``coherence/_rejects/`` with their scores.

**Memory** does not grow with the corpus: the tag vectors stay memory-mapped (only the scored rows and the null's are
read), DuckDB draws the chunk samples from the vocabulary's (tag, chunk) pairs a bounded pass at a time
(``PAIRS_PER_PASS``), and only the drawn chunks (at most ``COHESION_SAMPLE`` a cluster) are read and embedded.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from atlas.config import PROJECT_ROOT
from atlas.core.extras import llm_extras
from atlas.core.files import ArtifactError, atomic_write_parquet
from atlas.core.rundir import RunDir
from atlas.core.stage import Stage
from atlas.core.stats import Stats
from atlas.io import layout
from atlas.io.library import inherits_sql
from atlas.io.outofcore import (
    PAIRS_PER_PASS,
    budget_slices,
    duckdb_session,
    scratch,
    sql_list,
)
from atlas.io.tags import float_rows, load_vocab
from atlas.llm.engine import LLMRequest, make_engine, setup_engine
from atlas.llm.prompts import load_prompt
from atlas.models.embedder import Embedder, embed_chunks, excess_cohesion, excess_over, mean_pairwise_cosine

COHERENCE_VERSION = 4  # 3: the cross-tag test; 4: library.min_concept_chunks
NULL_SETS = 200  # random tag sets per set size: the offline null
COHESION_SAMPLE = 200  # chunks per cluster (and of the corpus) whose embeddings measure chunk cohesion
OFFLINE_SCORE_CURVE = ((0.0, 1.0), (3.0, 6.5), (12.0, 8.5), (18.75, 10.0))  # offline: (z, score) points, see above
STRATA = ("core", "random", "edge")
COHERENCE_SCHEMA = pa.schema(
    [("cluster_id", pa.int64()), ("size", pa.int64()), ("count", pa.int64()), ("core_score", pa.int8()),
     ("random_score", pa.int8()), ("edge_score", pa.int8()), ("chunk_cohesion", pa.float32()),
     ("cross_tag_cohesion", pa.float32()), ("n_chunks", pa.int64()), ("kept", pa.bool_()), ("reason", pa.string())]
)
SCORE_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["score"],
                "properties": {"score": {"type": "integer", "minimum": 1, "maximum": 10}}}


def null_cohesion(x: np.ndarray, sizes: set[int], seed: int) -> dict[int, tuple[float, float]]:
    """Per set size: mean and standard deviation of the mean pairwise cosine of NULL_SETS random tag sets."""
    rng = np.random.default_rng([seed, 7])
    null = {}
    for n in sorted(s for s in sizes if 2 <= s <= len(x)):
        values = [mean_pairwise_cosine(float_rows(x, rng.choice(len(x), n, replace=False))) for _ in range(NULL_SETS)]
        null[n] = (float(np.mean(values)), float(np.std(values)) or 1e-6)
    return null


def cohesion_score(vectors: np.ndarray, null: dict[int, tuple[float, float]], reference: int) -> int:
    """The set's distance from random sets of its size, on the 1-10 scale (a set of one tag: 10).

    z = (cohesion - null mean of its size) / null std of a ``reference``-size set (the strata size): a fixed
    effect size, so a small cluster's set is not penalized for the wider spread of small random sets."""
    if len(vectors) < 2:
        return 10
    z = (mean_pairwise_cosine(vectors) - null[len(vectors)][0]) / null[reference][1]
    return int(np.floor(np.interp(z, *zip(*OFFLINE_SCORE_CURVE)) + 0.5))  # half up: 6.5 scores 7


def strata(members: np.ndarray, similarity: np.ndarray, size: int, rng: np.random.Generator) -> dict:
    """Indices of the core, random and edge sets of one cluster (all the same when it is small)."""
    order = members[np.argsort(-similarity[members], kind="stable")]
    if len(order) <= size:
        return {name: order for name in STRATA}
    return {"core": order[:size], "random": np.sort(rng.choice(order, size, replace=False)), "edge": order[-size:]}


def cross_tag_cohesion(vectors: np.ndarray, tags: list[tuple[str, ...]], baseline: float) -> float | None:
    """The excess over random chunks (``excess_over``) of the mean cosine of the pairs of chunks that share none of
    the cluster's tags (``tags``: each chunk's); None when no pair does (one tag: the chunk test covers it)."""
    column = {tag: j for j, tag in enumerate(sorted({tag for chunk_tags in tags for tag in chunk_tags}))}
    has = np.zeros((len(tags), len(column)), dtype=np.float32)
    for i, chunk_tags in enumerate(tags):
        has[i, [column[tag] for tag in chunk_tags]] = 1
    disjoint = (has @ has.T) == 0  # a chunk shares its own tags: the diagonal is never counted
    if not disjoint.any():
        return None
    return float(excess_over((vectors @ vectors.T)[disjoint].mean(), baseline))


def sample_positions(n: int, rng: np.random.Generator) -> np.ndarray:
    """Positions of the chunks sampled from ``n`` (all of them up to COHESION_SAMPLE), ascending."""
    return np.sort(rng.choice(n, COHESION_SAMPLE, replace=False)) if n > COHESION_SAMPLE else np.arange(n)


def coherence_prompt():
    return load_prompt(PROJECT_ROOT / "prompts" / "judge_coherence.yaml", {"system": set(), "user": {"tags"}})


class CoherenceStage(Stage):
    name = "coherence"
    output = layout.COHERENCE
    upstream = ("cluster",)
    needs = ("embed", "library")

    def extras(self) -> tuple[str, ...]:
        return self.needs + llm_extras(self.config.llm.engine)

    def identity(self) -> dict:
        c = self.config.library
        identity = {"version": COHERENCE_VERSION, "seed": c.seed, "strata_size": c.strata_size,
                    "thresholds": [c.core_min, c.random_min, c.edge_min], "min_chunk_cohesion": c.min_chunk_cohesion,
                    "min_cross_tag_cohesion": c.min_cross_tag_cohesion, "min_concept_chunks": c.min_concept_chunks,
                    "inherit_floors": [c.tag_min_similarity, c.joined_min_similarity],
                    "chunk_encoder": self.config.annotator.encoder, "cohesion_sample": COHESION_SAMPLE}
        if self.config.llm.engine == "offline":
            return identity | {"offline_null": {"sets": NULL_SETS, "curve": OFFLINE_SCORE_CURVE}}
        engine = make_engine(self.config.llm).identity()
        return identity | {"engine": engine, "prompt_sha256": coherence_prompt().sha256}

    def setup(self) -> None:
        self.embedder = Embedder(self.config.annotator.encoder)  # chunks only: the tag vectors come from vocab
        self.prompt = coherence_prompt()
        self.engine = setup_engine(self.config.llm)  # None offline: embedding cohesion

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.close()

    def run_shard(self, run: RunDir, shard: int) -> Stats:
        from atlas.models.kmeans import members_of_clusters  # faiss and scikit-learn: the library extra

        c = self.config.library
        vocab, vectors = load_vocab(run, ["n_chunks"])  # float16, memory-mapped: only the rows scored are read
        clustered = run.output_dir(layout.CLUSTERS) / layout.CLUSTER_VECTORS  # tags joined with their contexts
        if clustered.exists():  # judged in the space k-means made the clusters in (see atlas/stages/cluster.py)
            vectors = np.load(clustered, mmap_mode="r", allow_pickle=False)
            if vectors.ndim != 2 or len(vectors) != vocab.num_rows:
                raise ArtifactError(f"{clustered}: shape {vectors.shape}, but the vocabulary has {vocab.num_rows} "
                                    "tags (row i is tag i); rerun the cluster stage with --force")
        clusters = pq.read_table(run.part_path(layout.CLUSTERS, 0), columns=["cluster_id", "similarity", "count"])
        labels = clusters.column("cluster_id").to_numpy()
        similarity = clusters.column("similarity").to_numpy()
        counts = clusters.column("count").to_numpy()
        members_of = members_of_clusters(labels)
        sets = {}  # (cluster, stratum) -> tag indices
        for cluster, members in members_of.items():
            rng = np.random.default_rng([c.seed, cluster])
            for stratum, indices in strata(members, similarity, c.strata_size, rng).items():
                sets[(cluster, stratum)] = indices
        scores = self._score(run, sets, vectors)
        n_chunks = vocab.column("n_chunks").to_numpy()
        pairs = np.array([n_chunks[members].sum() for members in members_of.values()], dtype=np.int64)
        tested = c.min_chunk_cohesion > 0 or c.min_cross_tag_cohesion > 0 or c.min_concept_chunks > 1
        cohesion, chunks_of = self._chunk_cohesion(run, np.array(list(members_of)), pairs) if tested else ({}, {})

        rows, stats = [], Stats({"clusters_in": len(members_of)})
        for cluster, members in members_of.items():
            core, rand, edge = (scores.get((cluster, s)) for s in STRATA)
            ratio, cross = cohesion.get(cluster, (None, None))  # None: not measured, or a cluster of one chunk
            if None in (core, rand, edge):
                kept, reason = False, "judge_failed"
            else:
                failed = [f"{s}={v}<{m}" for s, v, m in zip(STRATA, (core, rand, edge),
                                                             (c.core_min, c.random_min, c.edge_min)) if v < m]
                if ratio is not None and ratio < c.min_chunk_cohesion:
                    failed.append(f"chunks={ratio:.3f}<{c.min_chunk_cohesion}")
                if cross is not None and cross < c.min_cross_tag_cohesion:  # None: no two chunks of other tags
                    failed.append(f"across tags={cross:.3f}<{c.min_cross_tag_cohesion}")
                if chunks_of.get(cluster, c.min_concept_chunks) < c.min_concept_chunks:  # absent: not counted
                    failed.append(f"covered={chunks_of[cluster]}<{c.min_concept_chunks}")
                kept, reason = not failed, "; ".join(failed) or "kept"
            rows.append({"cluster_id": cluster, "size": len(members), "count": int(counts[members].sum()),
                         "core_score": core, "random_score": rand, "edge_score": edge,
                         "chunk_cohesion": ratio, "cross_tag_cohesion": cross, "n_chunks": chunks_of.get(cluster),
                         "kept": kept, "reason": reason})
            stats.inc("clusters_kept" if kept else "clusters_dropped")
            if not kept:
                stats.drop("judge_failed" if reason == "judge_failed" else "incoherent")
        atomic_write_parquet(run.part_path(self.output, 0), pa.Table.from_pylist(rows, schema=COHERENCE_SCHEMA))
        run.write_rejects(self.output, 0, [r for r in rows if not r["kept"]], COHERENCE_SCHEMA)
        self._plot(run, rows)
        return stats

    def _chunk_cohesion(self, run: RunDir, clusters: np.ndarray,
                        pairs: np.ndarray) -> tuple[dict[int, tuple[float | None, float | None]], dict[int, int]]:
        """Per cluster (``clusters``, ascending, with about ``pairs`` (tag, chunk) pairs each): the excess cohesion of
        its chunks over random chunks, and that of its chunks across tags (see the module docstring); and on how many
        distinct chunks the tags that will inherit its concept are."""
        tmp = run.output_dir(layout.TMP) / self.name  # spill files, removed after
        memory_gb = self.config.execution.memory_gb
        with scratch(tmp):
            with duckdb_session(tmp, memory_gb) as con:
                vocab = f"read_parquet({sql_list([run.part_path(layout.TAG_VOCAB, 0)])})"
                con.execute(f"CREATE VIEW tag_chunks AS SELECT k.cluster_id, v.tag_norm, v.chunk_ids, "
                            f"{inherits_sql(self.config.library, 'k')} AS inherits "
                            f"FROM {vocab} v "
                            f"JOIN read_parquet({sql_list([run.part_path(layout.CLUSTERS, 0)])}) k USING (tag_norm)")
                con.execute(f"CREATE VIEW every_chunk AS SELECT unnest(chunk_ids) AS chunk_id FROM {vocab}")
                covered, chunks_of = self._cluster_samples(con, clusters, pairs)
                background = self._background_sample(con, int(pairs.sum()))
            ids = sorted({chunk for chunks in covered.values() for chunk, _ in chunks} | set(background))
            with duckdb_session(tmp, memory_gb) as con:  # a new session: the sampling's memory is given back first
                vectors, _ = embed_chunks(con, run, ids, self.embedder, self.config.annotator.embed_batch_size)
        row = {chunk: i for i, chunk in enumerate(ids)}
        if len(background) < 2:
            return {}, chunks_of
        baseline = mean_pairwise_cosine(float_rows(vectors, [row[i] for i in background]))
        out = {}
        for cluster, chunks in covered.items():
            x = float_rows(vectors, [row[chunk] for chunk, _ in chunks])
            out[cluster] = ((excess_cohesion(x, baseline), cross_tag_cohesion(x, [t for _, t in chunks], baseline))
                            if len(chunks) > 1 else (None, None))
        return out, chunks_of

    def _cluster_samples(self, con, clusters: np.ndarray,
                         pairs: np.ndarray) -> tuple[dict[int, list[tuple[str, tuple]]], dict[int, int]]:
        """Per cluster with chunks: the chunk ids drawn by position among its distinct chunk ids sorted (all of them
        up to COHESION_SAMPLE), each with the cluster's tags it has; and on how many distinct chunks its tags that will
        inherit its concept (``atlas.io.library.inherits``) are. DuckDB numbers the chunks of a range of
        clusters at a time (PAIRS_PER_PASS)."""
        covered, chunks_of = {}, {}
        for part in budget_slices(pairs, PAIRS_PER_PASS):
            con.execute(f"""CREATE OR REPLACE TABLE numbered AS SELECT cluster_id, chunk_id,
                                list(tag_norm ORDER BY tag_norm) AS tags, bool_or(inherits) AS inherits,
                                row_number() OVER (PARTITION BY cluster_id ORDER BY chunk_id) - 1 AS pos
                            FROM (SELECT cluster_id, inherits, tag_norm, unnest(chunk_ids) AS chunk_id
                                  FROM tag_chunks
                                  WHERE cluster_id BETWEEN {clusters[part][0]} AND {clusters[part][-1]})
                            GROUP BY cluster_id, chunk_id""")
            counted = con.execute("SELECT cluster_id, count(*), count(*) FILTER (WHERE inherits) FROM numbered "
                                  "GROUP BY cluster_id").fetchall()
            chunks_of.update({cluster: inheriting for cluster, _, inheriting in counted})
            drawn = {cluster: sample_positions(n, np.random.default_rng([self.config.library.seed, cluster, 1]))
                     for cluster, n, _ in counted}
            con.register("drawn", pa.table({
                "cluster_id": np.repeat(np.array(list(drawn), np.int64), [len(p) for p in drawn.values()]),
                "pos": np.concatenate([np.zeros(0, np.int64), *drawn.values()])}))
            for cluster, chunk, tags in con.execute("SELECT cluster_id, chunk_id, tags FROM numbered JOIN drawn "
                                                    "USING (cluster_id, pos) ORDER BY cluster_id, pos").fetchall():
                covered.setdefault(cluster, []).append((chunk, tuple(tags)))
            con.unregister("drawn")
        con.execute("DROP TABLE IF EXISTS numbered")
        return covered, chunks_of

    def _background_sample(self, con, n_pairs: int) -> list[str]:
        """The chunk ids drawn by position among every chunk id of the vocabulary sorted (all of them up to
        COHESION_SAMPLE). DuckDB counts, then numbers, the ids of one range at a time (about PAIRS_PER_PASS (tag,
        chunk) pairs each, split at the ids of a hashed sample): it never holds every id."""
        ranges = -(-n_pairs // PAIRS_PER_PASS)
        bounds = []
        if ranges > 1:  # about 100 sample ids a range; only the split depends on them, not the draw
            every = max(n_pairs // (100 * ranges), 1)  # inlined: as a parameter, DuckDB is 20x slower here
            sample = sorted(chunk for chunk, in con.execute(
                f"SELECT DISTINCT chunk_id FROM every_chunk WHERE hash(chunk_id) % {every} = 0").fetchall())
            bounds = sorted({sample[len(sample) * i // ranges] for i in range(1, ranges)}) if sample else []
        edges = [{"lo": lo, "hi": hi} for lo, hi in zip(["", *bounds], [*bounds, None])]  # [lo, hi), None: no end
        where = "chunk_id >= $lo AND ($hi IS NULL OR chunk_id < $hi)"
        counts = [con.execute(f"SELECT count(DISTINCT chunk_id) FROM every_chunk WHERE {where}", edge).fetchone()[0]
                  for edge in edges]
        drawn = sample_positions(sum(counts), np.random.default_rng([self.config.library.seed, 2]))
        background, start = [], 0
        for edge, n in zip(edges, counts):
            mine = drawn[(drawn >= start) & (drawn < start + n)] - start  # positions in this range
            start += n
            if len(mine) == 0:
                continue
            con.register("drawn", pa.table({"pos": mine}))
            background += [chunk for chunk, in con.execute(f"""
                SELECT chunk_id FROM (SELECT chunk_id, row_number() OVER (ORDER BY chunk_id) - 1 AS pos
                                      FROM (SELECT DISTINCT chunk_id FROM every_chunk WHERE {where}))
                JOIN drawn USING (pos) ORDER BY pos""", edge).fetchall()]
            con.unregister("drawn")
        return background

    def _score(self, run: RunDir, sets: dict, x: np.ndarray) -> dict:
        if self.engine is None:
            reference = min(self.config.library.strata_size, len(x))
            sizes = {len(indices) for indices in sets.values()} | {reference}
            null = null_cohesion(x, sizes, self.config.library.seed)
            return {key: cohesion_score(float_rows(x, indices), null, reference) for key, indices in sets.items()}
        prompt, keys = self.prompt, list(sets)
        tags = pq.read_table(run.part_path(layout.CLUSTERS, 0), columns=["tag_norm"]).column(0)
        listed = {key: "\n".join(f"- {t}" for t in tags.take(indices).to_pylist()) for key, indices in sets.items()}
        requests = [LLMRequest(key=f"{cluster}:{stratum}", system=prompt.templates["system"],
                               user=prompt.render("user", tags=listed[(cluster, stratum)]),
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
