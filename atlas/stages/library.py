"""Stage ``library`` (global): merge near-duplicate concepts and write the concept library (paper 4.2.2).

Dedup: each concept is embedded as "name: description"; edges join the ``library.dedup_m`` nearest
concepts with cosine >= tau; Louvain communities (python-louvain, seeded) are merged into one
concept. At each tau (0.95, 0.90, 0.85) the concepts are re-embedded and the pass repeated (at
most 3 times) until a pass merges no more than ``library.dedup_min_merged`` of them. Then concepts
whose names alone have cosine > ``library.name_merge_tau`` (0.9: "http" and "https") are merged the
same way. A merged concept keeps the name and description of its most used member (offline) or gets
new ones from the LLM labeler, and records every cluster it came from (``merged_from``).

The labels of the auxiliary domains (``library.aux_domains``: tone, demographic, alignment; finite
lists in ``schemas/aux/``) follow the content concepts in the same id space: ``config.json`` holds
``domain_offsets`` and ``domain_sizes``, and a label's global id is its domain's offset plus its
position in the list. Their ``chunk_count`` is null until the corpus is annotated.

    library/concepts.parquet        concept_id (dense, by chunk_count), domain, is_tone, is_alignment,
                                    is_demographic (the domain as flags), name, description, evidence_tags,
                                    n_tags, chunk_count, prevalence, taxonomy_path, merged_from, lifted_words
    library/tag_to_concept.parquet  tag_norm, cluster_id, concept_id (null: the cluster was dropped, or the tag is
                                    at its edge: below library.tag_min_similarity to its centroid and, clustered
                                    with contexts, below library.joined_min_similarity to it in the joined space),
                                    near_concept_id
    library/near_votes.parquet      chunk_id, concept_id, votes: its tag occurrences' near votes, read in the chunk
                                    (clustered with contexts only)
    library/config.json             k, the tag fields the concepts come from (``fields``: a chunk inherits
                                    concepts through the tags of these fields only), thresholds, models,
                                    dedup passes, domain offsets, stage hashes
    report/concept_sizes.png, report/concept_map.png

A tag's near concept (``near_concept_id``) is the concept of its nearest kept cluster whose concept is not the tag's
own, at cosine >= ``library.tag_min_similarity`` to that cluster's centroid (searched among its 8 nearest kept
clusters; null where none is that close); clustered with contexts, in the space k-means fit (the tag joined with its
chunks), at ``library.joined_min_similarity``. A tag often sits between two concepts ("embassy evacuation": embassy,
evacuation; "british intelligence": espionage, british occupation), and a tag of a dropped cluster has no concept of
its own; the library's reading of a chunk (``chunk_concept_votes``, which ``atlas eval library`` reads) gives the
near concept ``library.near_concept_weight`` of a vote. The annotator's targets, ``chunk_count`` and the lifted words
count own concepts only: a positive must be sure.

**Near concepts read in each chunk** (library version 7; clustered with contexts). A tag's words, and even the mean of
its chunks, are often far from what one text it was given to is about ("lcc int" in a story of shares that tumbled,
"rover" in one of Mars' watery past). So each occurrence of a tag is read with its own chunk
(``near_votes_in_context``): the tag joined with that chunk's embedding, as k-means' points joined it with its chunks'
mean, is compared with its tag's 8 nearest kept clusters, and the nearest one's concept at
``library.near_min_similarity`` (0.3) or more that is not the tag's own gets a near vote; a tag with no concept of its
own (its cluster dropped, or at its edge: 11% of the dev corpus' tag occurrences) gives its two nearest concepts one
each. ``near_votes.parquet`` holds them, per chunk and concept; the library's reading counts them instead of the tags'
``near_concept_id``. Over library seeds 0-2 of the dev corpus this put the library's AG News level with or above plain
clustering, where it had been under it at every seed (docs/quality.md).

**Which tags inherit** (library version 6). Clustered with contexts, a cluster holds tags that k-means put there by
their chunks ("nci guideline" with mammography, "serbian american inventor" with Nikola Tesla) whose words are far
from the cluster's mean tag. Judged by the words alone they were at the edge and inherited nothing (6,203 of the
dev corpus' 28,885 tags at seed 0), and their near concept was that of other words like them ("kmart holding corp":
a concept of company names). Both now read the space the cluster was made in as well; over library seeds 0-2 of
the dev corpus the library's homogeneity ratios rose on 20 Newsgroups and code, and its MATH probe (docs/quality.md).

Lifted words (paper 4.4, appendix D.1): lift(w, c) = P(w | c) / P(w) over the words of the chunks
a concept covers, for words seen in at least ``library.lift_min_support`` of them. Which chunks each concept
covers, and the words of every chunk, are joined out of core (DuckDB, at most ``execution.memory_gb``, spilling
to ``RUN/_tmp/library/``): memory holds the concepts and a batch of chunk texts, not the corpus.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from atlas.core.extras import llm_extras
from atlas.core.files import ArtifactError, atomic_write_json, atomic_write_parquet, read_json
from atlas.core.rundir import RunDir
from atlas.core.stage import Stage
from atlas.core.stats import Stats
from atlas.io import layout
from atlas.io.library import (
    CONCEPT_SCHEMA,
    NEAR_VOTES_SCHEMA,
    TAG_TO_CONCEPT_SCHEMA,
    domain_flags,
    inherits,
    inherits_sql,
)
from atlas.io.outofcore import PartWriter, checked_parts, duckdb_session, record_batches, scratch, sql_list
from atlas.io.tags import float_rows, load_vocab, tag_parts, vocab_fields
from atlas.llm.engine import make_engine, setup_engine
from atlas.llm.offline import singular_name
from atlas.models.auxiliary import configured_domains, list_hashes
from atlas.models.embedder import Embedder, embed_chunks, encode_cached
from atlas.models.labeler import label_prompt, llm_labels, make_unique

LIBRARY_VERSION = 8  # 4: config.json names the fields the concepts come from; 5: near_concept_id; 6: joined space
# 7: near votes read in each chunk (near_votes.parquet); 8: the group flags (is_tone, ...) in concepts.parquet
CHUNK_WORDS_SCHEMA = pa.schema([("idx", pa.int64()), ("word", pa.string())])
LIFTED_KEPT = 10
MAX_PASSES_PER_TAU = 3
NEAR_SEARCHED = 8  # kept clusters searched for a tag's near concept (a concept can be merged from several)
OCCURRENCE_BLOCK = 8192  # tag occurrences compared with their candidate centroids at once (bounds the joined rows)


def word_analyzer():
    """The words of a text, as lift counts them: lowercase, 3+ ASCII letters, no English stop words."""
    from sklearn.feature_extraction.text import CountVectorizer

    return CountVectorizer(stop_words="english", token_pattern=r"(?u)\b[a-zA-Z][a-zA-Z]{2,}\b").build_analyzer()


def lifted_words(con, chunk_texts, min_support: int, spill: Path, top: int = LIFTED_KEPT) -> dict[int, list[str]]:
    """For each concept, the words with the highest lift P(w|c) / P(w) (at most ``top``, each with lift > 1).

    ``con`` holds ``covered`` (concept, idx: the chunks each concept covers) and ``chunk_texts`` streams
    (idx, chunk_text) batches of every chunk whose words count. Ties: more of the concept's chunks, then the word.
    Lift is computed per (concept, word) from integer counts, in float64, as numpy would. Each chunk's words go to
    ``spill/chunk_words.parquet`` as they are found (inserted into a DuckDB table, they kept the process's memory
    growing with the corpus: 1M chunks, +170 MiB)."""
    analyze = word_analyzer()
    n = 0
    words_file = spill / "chunk_words.parquet"
    with pq.ParquetWriter(words_file, CHUNK_WORDS_SCHEMA) as writer:
        for batch in chunk_texts:
            words = [sorted(set(analyze(text))) for text in batch.column("chunk_text").to_pylist()]
            idx = np.repeat(batch.column("idx").to_numpy(), [len(w) for w in words])
            writer.write_table(pa.table([idx, pa.array([w for ws in words for w in ws], pa.string())],
                                        schema=CHUNK_WORDS_SCHEMA))
            n += batch.num_rows
    if n == 0:
        return {}
    con.execute(f"CREATE VIEW chunk_words AS SELECT * FROM read_parquet({sql_list([words_file])})")
    rows = con.execute("""
        WITH sizes AS (SELECT concept, count(*) AS size FROM covered GROUP BY concept),
             df AS (SELECT word, count(*) AS df FROM chunk_words GROUP BY word),
             hits AS (SELECT c.concept, w.word, count(*) AS hits FROM covered c JOIN chunk_words w USING (idx)
                      GROUP BY c.concept, w.word HAVING count(*) >= $min_support),
             lift AS (SELECT h.concept, h.word, h.hits, (h.hits / s.size) / (d.df / $n) AS lift
                      FROM hits h JOIN sizes s USING (concept) JOIN df d USING (word))
        SELECT concept, list(word ORDER BY lift DESC, hits DESC, word) AS words FROM (
            SELECT * FROM lift WHERE lift > 1
            QUALIFY row_number() OVER (PARTITION BY concept ORDER BY lift DESC, hits DESC, word) <= $top)
        GROUP BY concept""", {"min_support": min_support, "n": n, "top": top}).fetchall()
    return dict(rows)


def tag_embeddings(run: RunDir, tags: list[str]) -> np.ndarray:
    """The vocabulary's tag embeddings, memory-mapped, checked to be those of ``tags`` in their order."""
    vocab, vectors = load_vocab(run, ["tag_norm"])
    if vocab.column("tag_norm").to_pylist() != tags:
        raise ArtifactError(f"{run.part_path(layout.CLUSTERS, 0)}: its tags are not those of "
                            f"{run.output_dir(layout.TAG_VOCAB)}, in their order; rerun the cluster stage with "
                            "--force")
    return vectors


def joined_space(run: RunDir, kept, n_tags: int) -> tuple[np.ndarray, np.ndarray]:
    """Clustered with contexts, the space k-means fit: every tag's joined vector (memory-mapped, row i: tag i) and the
    ``kept`` clusters' joined centroids, in that order."""
    folder = run.output_dir(layout.CLUSTERS)
    vectors = np.load(folder / layout.CLUSTER_VECTORS, mmap_mode="r", allow_pickle=False)
    if len(vectors) != n_tags:
        raise ArtifactError(f"{folder / layout.CLUSTER_VECTORS}: {len(vectors)} rows for {n_tags} tags; rerun the "
                            "cluster stage with --force")
    return vectors, np.load(folder / layout.CLUSTER_JOINED_CENTROIDS, allow_pickle=False)[kept].astype(np.float32)


def near_concepts(run: RunDir, concept_of_cluster: dict[int, int], tags: list[str], own: list[int | None],
                  floor: float, joined_floor: float, batch_size: int = 65_536) -> list[int | None]:
    """Each vocabulary tag's near concept (``tags``: the vocabulary's, in its order; ``own``: their concepts): that of
    its nearest kept cluster whose concept is not its own, at similarity >= ``floor``; None where no such cluster is
    among its ``NEAR_SEARCHED`` nearest kept ones. Clustered with contexts, in the space k-means fit (the joined
    vectors and centroids of ``clusters/``, at ``joined_floor``), else in the tags' own: a tag's words alone find
    another of their kind ("kmart holding corp": a concept of company names), its chunks what it is said of. Tags are
    searched a batch at a time (memory: a batch, not the vocabulary)."""
    from atlas.models.kmeans import nearest_centroids  # faiss loads only when a library is built

    kept = np.asarray(sorted(concept_of_cluster), dtype=np.int64)
    if len(kept) == 0:
        return [None] * len(own)
    folder = run.output_dir(layout.CLUSTERS)
    concept = np.asarray([concept_of_cluster[c] for c in kept.tolist()], dtype=np.int64)
    own_concept = np.asarray([-1 if c is None else c for c in own], dtype=np.int64)
    vectors = tag_embeddings(run, tags)
    if (folder / layout.CLUSTER_JOINED_CENTROIDS).exists():  # clustered with contexts: search where k-means fit
        vectors, centroids = joined_space(run, kept, len(tags))
        floor = joined_floor
    else:
        centroids = np.load(folder / layout.CLUSTER_CENTROIDS, allow_pickle=False)[kept]
    near: list[int | None] = []
    searched = min(NEAR_SEARCHED, len(kept))
    for start in range(0, len(own_concept), batch_size):
        ids, similarity = nearest_centroids(vectors[start:start + batch_size], centroids, searched)
        candidates = concept[ids]  # [batch, searched], nearest first
        other = (candidates != own_concept[start:start + len(ids), None]) & (similarity >= floor)
        first = other.argmax(axis=1)
        near += [int(candidates[row, col]) if other[row, col] else None for row, col in enumerate(first.tolist())]
    return near


def near_votes_in_context(run: RunDir, concept_of_cluster: dict[int, int], tags: list[str], own: list[int | None],
                          fields: list[str] | None, context_weight: float, floor: float, encoder: Embedder,
                          batch_size: int, memory_gb: float, path: Path, progress: bool = True) -> int:
    """Each tag occurrence's near concepts, read in its chunk (clustered with contexts), written to ``path`` as rows
    (chunk_id, concept_id, votes): how many of the chunk's tag occurrences give the concept a near vote. Returns how
    many occurrences have one.

    An occurrence is the tag joined with *its* chunk's embedding (``join_context``, as k-means' points joined a tag
    with the mean of its chunks), compared with its tag's ``NEAR_SEARCHED`` nearest kept clusters in that space; its
    near concept is the nearest one's at cosine >= ``floor`` that is not the tag's own, and a tag with no concept of
    its own (its cluster dropped, or at its edge) gives its two nearest concepts a near vote each. A tag's words alone
    are often far from the topic of the text it was given to ("lcc int" in a story on shares that tumbled); its chunk
    is not. Tags are those of ``fields`` (None: every field), one tag part at a time: its chunks' embeddings (the run's
    cache, else ``encoder``) and its rows are what memory holds."""
    from tqdm.auto import tqdm

    from atlas.models.kmeans import join_context, nearest_centroids

    kept = sorted(concept_of_cluster)
    if not kept:  # no concept to vote for
        with PartWriter(path, NEAR_VOTES_SCHEMA):
            return 0
    concept = np.asarray([concept_of_cluster[c] for c in kept], dtype=np.int64)
    tag_vectors = tag_embeddings(run, tags)
    joined_tags, centroids = joined_space(run, kept, len(tags))
    row_of_tag = {tag: i for i, tag in enumerate(tags)}
    own_concept = np.asarray([-1 if c is None else c for c in own], dtype=np.int64)
    searched, with_near = min(NEAR_SEARCHED, len(kept)), 0
    parts = tag_parts(run)
    tmp = run.output_dir(layout.TMP) / "library"
    with (scratch(tmp), duckdb_session(tmp, memory_gb) as con, PartWriter(path, NEAR_VOTES_SCHEMA) as writer,
          tqdm(total=len(parts), desc="library: near concepts in context", unit="part", disable=not progress) as bar):
        for part in parts:
            table = pq.read_table(part, columns=["chunk_id", "field", "tag_norm"])
            if fields is not None:
                table = table.filter(pc.is_in(table.column("field"), pa.array(fields, pa.string())))
            tag_row = np.asarray([row_of_tag.get(t, -1) for t in table.column("tag_norm").to_pylist()], dtype=np.int64)
            known = tag_row >= 0
            ids, chunk_row = np.unique(np.asarray(table.column("chunk_id").to_pylist(), dtype=object)[known],
                                       return_inverse=True)
            tag_row = tag_row[known]
            pairs = [np.zeros((0, 2), np.int64)]  # (chunk row, concept) of each near vote
            vectors = embed_chunks(con, run, ids.tolist(), encoder, batch_size)[0] if len(ids) else None
            for start in range(0, len(tag_row), OCCURRENCE_BLOCK):
                t, c = tag_row[start:start + OCCURRENCE_BLOCK], chunk_row[start:start + OCCURRENCE_BLOCK]
                occurrence = join_context(float_rows(tag_vectors, t), vectors[c].astype(np.float32), context_weight)
                candidate, _ = nearest_centroids(float_rows(joined_tags, t), centroids, searched)
                similarity = np.stack([(occurrence * centroids[candidate[:, j]]).sum(axis=1) for j in range(searched)],
                                      axis=1)
                order = np.argsort(-similarity, axis=1, kind="stable")  # nearest the occurrence first
                candidate = concept[np.take_along_axis(candidate, order, axis=1)]
                close = np.take_along_axis(similarity, order, axis=1) >= floor
                every = np.arange(len(t))
                other = close & (candidate != own_concept[t, None])
                first = other.argmax(axis=1)
                nearest, has_near = candidate[every, first], other[every, first]
                rest = other & (candidate != nearest[:, None])  # a tag without a concept: its second nearest too
                second = rest.argmax(axis=1)
                has_second = rest[every, second] & has_near & (own_concept[t] < 0)
                with_near += int(has_near.sum())
                pairs += [np.stack([c[has_near], nearest[has_near]], axis=1),
                          np.stack([c[has_second], candidate[every, second][has_second]], axis=1)]
            voted, votes = np.unique(np.concatenate(pairs), axis=0, return_counts=True)  # by chunk, then concept
            writer.write(pa.table({"chunk_id": pa.array(ids[voted[:, 0]].tolist(), pa.string()),
                                   "concept_id": voted[:, 1], "votes": votes.astype(np.float32)},
                                  schema=NEAR_VOTES_SCHEMA))
            bar.update(1)
    return with_near


class LibraryStage(Stage):
    name = "library"
    output = layout.LIBRARY
    upstream = ("label",)
    needs = ("embed", "library")

    def extras(self) -> tuple[str, ...]:
        return self.needs + llm_extras(self.config.llm.engine)

    def identity(self) -> dict:
        c = self.config.library
        identity = {"version": LIBRARY_VERSION, "seed": c.seed, "taus": c.dedup_taus, "m": c.dedup_m,
                    "min_merged": c.dedup_min_merged, "name_merge_tau": c.name_merge_tau,
                    "lift_min_support": c.lift_min_support, "tag_min_similarity": c.tag_min_similarity,
                    "joined_min_similarity": c.joined_min_similarity, "near_min_similarity": c.near_min_similarity,
                    "embedding_model": self.config.vocab.embedding_model,
                    "aux_files": list_hashes(configured_domains(self.config))}
        if self.config.llm.engine == "offline":
            return identity
        return identity | {"engine": make_engine(self.config.llm).identity(), "prompt_sha256": label_prompt().sha256}

    def setup(self) -> None:
        self.embedder = Embedder(self.config.vocab.embedding_model)
        self.chunk_encoder = Embedder(self.config.annotator.encoder)  # loaded only if a chunk is not in the cache
        self.engine = setup_engine(self.config.llm)  # None offline: merged concepts keep their largest member's label

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.close()

    def run_shard(self, run: RunDir, shard: int) -> Stats:
        sweep = read_json(run.output_dir(layout.CLUSTERS) / "_sweep.json")  # read first: a damaged file stops no work
        labels = pq.read_table(run.part_path(layout.LABELS, 0)).to_pylist()
        concepts = [{"name": r["name"], "description": r["description"], "count": r["count"], "n_tags": r["n_tags"],
                     "evidence": list(r["evidence_tags"]), "merged_from": [r["cluster_id"]]} for r in labels]
        stats = Stats({"concepts_labeled": len(concepts)})
        passes = self._dedup(concepts, run, stats)
        passes += self._merge_names(concepts, run, stats)

        clusters = pq.read_table(run.part_path(layout.CLUSTERS, 0)).to_pydict()
        chunk_count, lifted, n_chunks = self._coverage(run, concepts)
        for i, concept in enumerate(concepts):
            concept["chunk_count"], concept["lifted"] = chunk_count.get(i, 0), lifted.get(i, [])
        concepts.sort(key=lambda c: (-c["chunk_count"], c["name"]))  # dense ids, most used first
        rows = [{"concept_id": i, "domain": "content", **domain_flags("content"), "name": c["name"],
                 "description": c["description"], "evidence_tags": c["evidence"], "n_tags": c["n_tags"],
                 "chunk_count": c["chunk_count"], "prevalence": c["chunk_count"] / max(n_chunks, 1),
                 "taxonomy_path": None, "merged_from": sorted(c["merged_from"]), "lifted_words": c["lifted"]}
                for i, c in enumerate(concepts)]
        concept_of_cluster = {cluster: row["concept_id"] for row in rows for cluster in row["merged_from"]}
        offsets, n_content = {"content": 0}, len(rows)
        for domain in configured_domains(self.config):  # after the content concepts: tone, demographic, alignment
            offsets[domain.name] = len(rows)
            rows += [{"concept_id": len(rows) + i, "domain": domain.name, **domain_flags(domain.name),
                      "name": label["name"], "description": label["description"], "evidence_tags": [], "n_tags": 0,
                      "chunk_count": None, "prevalence": None, "taxonomy_path": None, "merged_from": [],
                      "lifted_words": []}
                     for i, label in enumerate(domain.labels)]
        c = self.config.library
        mapping = {"tag_norm": clusters["tag_norm"], "cluster_id": clusters["cluster_id"],
                   "concept_id": [concept_of_cluster.get(cluster) if inherits(similarity, joined, c) else None
                                  for cluster, similarity, joined in zip(
                                      clusters["cluster_id"], clusters["similarity"], clusters["joined_similarity"])]}
        mapping["near_concept_id"] = near_concepts(run, concept_of_cluster, mapping["tag_norm"], mapping["concept_id"],
                                                   c.tag_min_similarity, c.joined_min_similarity)

        folder, fields = run.output_dir(self.output), vocab_fields(run)
        atomic_write_parquet(folder / "concepts.parquet", pa.Table.from_pylist(rows, schema=CONCEPT_SCHEMA))
        atomic_write_parquet(folder / "tag_to_concept.parquet", pa.table(mapping, schema=TAG_TO_CONCEPT_SCHEMA))
        if (run.output_dir(layout.CLUSTERS) / layout.CLUSTER_JOINED_CENTROIDS).exists():  # clustered with contexts
            stats.inc("occurrences_with_near_concept", near_votes_in_context(
                run, concept_of_cluster, mapping["tag_norm"], mapping["concept_id"], fields, sweep["context_weight"],
                c.near_min_similarity, self.chunk_encoder, self.config.annotator.embed_batch_size,
                self.config.execution.memory_gb, folder / layout.LIBRARY_NEAR_VOTES, self.config.execution.progress))
        else:  # an earlier library's would be read instead of the tags' near concepts
            (folder / layout.LIBRARY_NEAR_VOTES).unlink(missing_ok=True)
        manifest = run.read_manifest()
        atomic_write_json(folder / "config.json", {
            "version": LIBRARY_VERSION, "n_concepts": len(rows), "domain_offsets": offsets,
            "domain_sizes": {d: sum(r["domain"] == d for r in rows) for d in offsets},
            "k": sweep["chosen_k"], "fields": fields, "library": self.config.library.model_dump(),
            "embedding_model": self.config.vocab.embedding_model, "llm_engine": self.config.llm.engine,
            "dedup_passes": passes,
            "stage_hashes": {name: info.get("hash") for name, info in manifest.get("stages", {}).items()},
        })
        stats.inc("concepts_out", n_content)
        stats.inc("aux_labels", len(rows) - n_content)
        stats.inc("tags_mapped", sum(c is not None for c in mapping["concept_id"]))
        stats.inc("tags_unmapped", sum(c is None for c in mapping["concept_id"]))
        stats.inc("tags_with_near_concept", sum(c is not None for c in mapping["near_concept_id"]))
        self._plot(run, rows[:n_content])
        return stats

    def _coverage(self, run: RunDir, concepts: list[dict]) -> tuple[dict[int, int], dict[int, list[str]], int]:
        """Per concept (its index in ``concepts``): how many chunks its tags came from, and its lifted words; and
        how many chunks the vocabulary came from in all."""
        vocab = run.part_path(layout.TAG_VOCAB, 0)
        chunks = checked_parts(run, layout.CHUNKS, ["chunk_id", "chunk_text"])
        of_cluster = [(cluster, i) for i, c in enumerate(concepts) for cluster in c["merged_from"]]
        tmp = run.output_dir(layout.TMP) / self.name  # spill files, removed after
        with scratch(tmp), duckdb_session(tmp, self.config.execution.memory_gb) as con:
            con.execute(f"CREATE VIEW vocab_chunks AS SELECT tag_norm, unnest(chunk_ids) AS chunk_id "
                        f"FROM read_parquet({sql_list([vocab])})")
            con.execute("CREATE TABLE every_chunk AS SELECT chunk_id, row_number() OVER () AS idx "
                        "FROM (SELECT DISTINCT chunk_id FROM vocab_chunks)")
            con.register("concept_of_cluster", pa.table({"cluster_id": [c for c, _ in of_cluster],
                                                         "concept": [i for _, i in of_cluster]},
                                                        schema=pa.schema([("cluster_id", pa.int64()),
                                                                          ("concept", pa.int64())])))
            con.execute(f"""CREATE TABLE covered AS SELECT DISTINCT c.concept, e.idx FROM vocab_chunks v
                            JOIN read_parquet({sql_list([run.part_path(layout.CLUSTERS, 0)])}) k USING (tag_norm)
                            JOIN concept_of_cluster c USING (cluster_id) JOIN every_chunk e USING (chunk_id)
                            WHERE {inherits_sql(self.config.library, "k")}""")
            n_chunks, = con.execute("SELECT count(*) FROM every_chunk").fetchone()
            chunk_count = dict(con.execute("SELECT concept, count(*) FROM covered GROUP BY concept").fetchall())
            con.execute(f"CREATE VIEW chunks AS SELECT chunk_id, chunk_text FROM read_parquet({sql_list(chunks)})")
            found, = con.execute("SELECT count(*) FROM every_chunk JOIN chunks USING (chunk_id)").fetchone()
            if found != n_chunks:
                raise ArtifactError(f"{run.output_dir(layout.CHUNKS)}: {abs(n_chunks - found)} chunk(s) of the tag "
                                    "vocabulary are missing from the chunk parts, or are there twice; recompute the "
                                    "chunk stage")
            texts = record_batches(con.cursor(), "SELECT e.idx, k.chunk_text FROM every_chunk e JOIN chunks k "
                                                 "USING (chunk_id)", rows=8192)
            lifted = lifted_words(con, texts, self.config.library.lift_min_support, tmp)
        return chunk_count, lifted, n_chunks

    def _embed(self, texts: list[str], run: RunDir) -> np.ndarray:
        vectors, _ = encode_cached(self.embedder, texts, run.root / layout.CACHE / "embeddings")
        return vectors.astype(np.float32)

    def _dedup(self, concepts: list[dict], run: RunDir, stats: Stats) -> list[dict]:
        c, passes = self.config.library, []
        for tau in c.dedup_taus:
            for _ in range(MAX_PASSES_PER_TAU):  # re-embed and repeat while a pass still merges something
                before = len(concepts)
                if before < 2:
                    return passes
                merged = self._merge_once(concepts, tau, run)
                concepts[:] = merged
                passes.append({"tau": tau, "concepts_before": before, "concepts_after": len(merged)})
                stats.inc(f"dedup_merged_tau_{tau:.2f}", before - len(merged))
                if before - len(merged) <= c.dedup_min_merged * before:
                    break
        return passes

    def _merge_names(self, concepts: list[dict], run: RunDir, stats: Stats) -> list[dict]:
        """Concepts whose names alone are near-synonyms ("http" and "https") are one concept, whatever their
        descriptions say: merged while two names have cosine > ``library.name_merge_tau`` (at most 3 passes). Names
        are compared in the singular ("huguenots" and "huguenot" are one name)."""
        tau, passes = self.config.library.name_merge_tau, []
        for _ in range(MAX_PASSES_PER_TAU):
            if len(concepts) < 2:
                break
            vectors = self._embed([singular_name(x["name"]) for x in concepts], run)
            vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
            similarity = vectors @ vectors.T
            np.fill_diagonal(similarity, -1)
            if similarity.max() <= tau:
                break
            before = len(concepts)
            concepts[:] = self._merge_once(concepts, np.nextafter(tau, 1), run, names_only=True)
            passes.append({"tau": tau, "names_only": True, "concepts_before": before, "concepts_after": len(concepts)})
            stats.inc("name_merged", before - len(concepts))
        return passes

    def _merge_once(self, concepts: list[dict], tau: float, run: RunDir, names_only: bool = False) -> list[dict]:
        from atlas.models.louvain import merge_pass  # faiss and networkx load only when a library is built

        c = self.config.library
        vectors = self._embed([singular_name(x["name"]) if names_only else f"{x['name']}: {x['description']}"
                               for x in concepts], run)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        groups: dict[int, list[dict]] = {}
        for concept, community in zip(concepts, merge_pass(vectors, tau, m=c.dedup_m, seed=c.seed).tolist()):
            groups.setdefault(community, []).append(concept)
        merged = [self._merge(group) for group in groups.values()]
        if self.engine is not None:
            renamed = [i for i, g in enumerate(groups.values()) if len(g) > 1]
            evidence = [[(t, 1) for t in merged[i]["evidence"]] for i in renamed]
            for i, answer in zip(renamed, llm_labels(self.engine, evidence) if renamed else []):
                if answer is not None:
                    merged[i]["name"], merged[i]["description"] = answer
        aux_names = [n for d in configured_domains(self.config) for n in d.names]
        for concept, name in zip(merged, make_unique([m["name"] for m in merged], [m["evidence"] for m in merged],
                                                     aux_names)):
            concept["name"] = name
        return merged

    @staticmethod
    def _merge(group: list[dict]) -> dict:
        """One concept from a community: the most used member's label, everything's evidence and lineage."""
        if len(group) == 1:
            return group[0]
        group = sorted(group, key=lambda x: (-x["count"], x["name"]))
        evidence = list(dict.fromkeys(t for x in group for t in x["evidence"]))[:20]
        return {"name": group[0]["name"], "description": group[0]["description"],
                "count": sum(x["count"] for x in group), "n_tags": sum(x["n_tags"] for x in group),
                "evidence": evidence, "merged_from": sorted(m for x in group for m in x["merged_from"])}

    def _plot(self, run: RunDir, rows: list[dict]) -> None:
        from atlas.core.plots import histogram, scatter

        if not rows:
            return
        sizes = np.array([r["chunk_count"] for r in rows])
        histogram(sizes, run.root / layout.REPORT / "concept_sizes.png", f"{len(rows)} concepts: chunks per concept",
                  "chunks per concept (log scale)", bins=np.unique(np.geomspace(1, max(sizes.max(), 2), 25).round()),
                  log_y=True, log_x=True)
        if len(rows) >= 3:
            vectors = self._embed([f"{r['name']}: {r['description']}" for r in rows], run)
            centered = vectors - vectors.mean(axis=0)
            points = centered @ np.linalg.svd(centered, full_matrices=False)[2][:2].T  # PCA to 2-D
            named = {i: rows[i]["name"] for i in range(min(25, len(rows)))}
            scatter(points, 4 + 60 * sizes / sizes.max(), named, run.root / layout.REPORT / "concept_map.png",
                    "concept map (PCA of name + description embeddings;\nthe 25 largest named where a label fits)")


