"""Stage ``vocab`` (global): tags -> the tag vocabulary and its embeddings (paper 4.2.2, first step).

Reads every tag shard and writes one row per normalized tag, most frequent first:

    tag_vocab/part-00000.parquet   tag_norm, count (occurrences), n_chunks, fields (where it was used),
                                   variants (up to 5 spellings as produced), chunk_ids (the chunks it came from)
    tag_vocab/_embeddings.npy       float16 [n_tags, d], L2-normalized, row i = tag i

Only the tags of the fields whose schema role is in ``vocab.roles`` enter (default: the topic fields,
so "how it is written" never becomes a content concept). Tags seen fewer than ``vocab.min_count``
times, generic tags (on more than ``vocab.max_chunk_share`` of the tagged chunks, and more than
``vocab.generic_min_chunks``: document frequency, the corpus statistic behind IDF and c-TF-IDF),
and single words outside the English lexicon seen in one chunk only (typos, code fragments, stray
strings) are left out and counted.

**Generic in context** (``vocab.min_context_specificity``). Document frequency misses the generic words that are
not the most frequent: "way", "value", "answer", "information". What gives them away is that the chunks they come
from have nothing in common. The ``vocab.context_max_tags`` most frequent tags on at least
``vocab.context_min_chunks`` chunks are tested: up to ``CONTEXT_SAMPLE`` of each tag's chunks (drawn by a hash of
the chunk id) are embedded with the annotator's encoder (``annotator.encoder``; its cache is the one targets and
annotate use), and within each domain with at least ``CONTEXT_DOMAIN_MIN`` of them their mean pairwise cosine m is
compared with that of ``CONTEXT_BACKGROUND`` random tagged chunks of the domain, r: the excess cohesion
(m - r) / (1 - r), as the coherence stage measures clusters. Its mean over the domains (weighted by the tag's
chunks in each) is the tag's context specificity; below the threshold (0.05) the tag is left out. Within each
domain, not over all of them: a topic that spans domains ("probability" in math and in code) is not generic for
that. On the dev corpus the test leaves out 29 of 678 tested tags, among them "way", "value", "find",
"possible", "information", "answer", "next year", "python" (as an algorithm of Python code) and
"fraction" (on 111 chunks across MATH's subjects, where it was the top concept of 34 documents of four of them).

The grouping runs out of core (DuckDB over the tag parts, at most ``execution.memory_gb``, spilling to
``RUN/_tmp/vocab/``), in steps whose memory does not grow with the corpus: each tag part is grouped on its own
(a chunk's tags are all in its shard's part, so its distinct chunks add up over parts); the (tag, chunk) pairs
are split into ranges of about ``PAIRS_PER_PASS`` by rank and each range is sorted on its own; and the
vocabulary is streamed to the part and to ``_embeddings.npy`` in its final order, a few thousand tags and their
chunk ids at a time. What grows is the table of distinct tags (Heaps' law: about N^0.75 for N tag rows).

Embeddings are cached in ``RUN/_cache/embeddings/`` (FP16, keyed by model and tag), so a rerun, or a
vocabulary that gained tags, only embeds what is new. The vocabulary is embedded in fixed batches of its
sorted order and a batch is computed whole or taken whole from the cache, so a resumed run gives the same
bytes as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pyarrow as pa

from atlas.core.rundir import RunDir
from atlas.core.stage import Stage
from atlas.core.stats import Stats
from atlas.io import layout
from atlas.io.outofcore import (
    PAIRS_PER_PASS,
    NpyWriter,
    PartWriter,
    SortedLists,
    budget_slices,
    checked_parts,
    duckdb_session,
    record_batches,
    scratch,
    sql_list,
    sql_string,
)
from atlas.io.tags import VOCAB_SCHEMA, tag_parts
from atlas.llm.answers import field_roles, load_schemas
from atlas.llm.offline import in_lexicon
from atlas.models.embedder import Embedder, embed_chunks, encode_cached, excess_cohesion, mean_pairwise_cosine

VOCAB_VERSION = 3
MAX_VARIANTS = 5
CONTEXT_SAMPLE = 32  # chunks of a tested tag whose embeddings measure its context
CONTEXT_DOMAIN_MIN = 4  # a domain counts in a tag's test with at least this many of its sampled chunks
CONTEXT_BACKGROUND = 200  # random tagged chunks per domain: the baseline r


def context_specificity(vectors: np.ndarray, domains: list[str], background: dict[str, float]) -> float | None:
    """A tag's context specificity from its sampled chunks' unit ``vectors`` and ``domains``: per domain with at least
    CONTEXT_DOMAIN_MIN of them, the excess cohesion (m - r) / (1 - r) over that domain's random chunks (``background``
    r), and their mean weighted by the chunks in each. None when no domain has enough of them (not tested)."""
    domains = np.asarray(domains)
    excess, weights = [], []
    for domain in sorted(set(domains.tolist())):
        rows = np.flatnonzero(domains == domain)
        if len(rows) < CONTEXT_DOMAIN_MIN or domain not in background:
            continue
        excess.append(excess_cohesion(vectors[rows], background[domain]))
        weights.append(len(rows))
    return float(np.average(excess, weights=weights)) if excess else None


def _in_lexicon(words: pa.Array) -> pa.Array:
    """in_lexicon over an Arrow column, for DuckDB."""
    return pa.array([in_lexicon(w) for w in words.to_pylist()], pa.bool_())


class VocabStage(Stage):
    name = "vocab"
    output = layout.TAG_VOCAB
    upstream = ("tag",)
    needs = ("embed",)

    def identity(self) -> dict:
        identity = {"version": VOCAB_VERSION, "vocab": self.config.vocab.model_dump()}
        if self.config.vocab.min_context_specificity > 0:
            identity["context"] = {"encoder": self.config.annotator.encoder, "sample": CONTEXT_SAMPLE,
                                   "domain_min": CONTEXT_DOMAIN_MIN, "background": CONTEXT_BACKGROUND}
        return identity

    def setup(self) -> None:
        self.embedder = Embedder(self.config.vocab.embedding_model)
        self.chunk_encoder = Embedder(self.config.annotator.encoder)  # loaded only if a chunk is not in the cache

    def run_shard(self, run: RunDir, shard: int) -> Stats:
        v = self.config.vocab
        parts = tag_parts(run)
        roles = field_roles(load_schemas(self.config.tag)[0])
        tmp = run.output_dir(layout.TMP) / self.name  # spill files, removed after
        with scratch(tmp), duckdb_session(tmp, self.config.execution.memory_gb) as con:
            con.execute(f"CREATE VIEW tags AS SELECT chunk_id, field, tag, tag_norm "
                        f"FROM read_parquet({sql_list(parts)})")
            fields = [f for (f,) in con.execute("SELECT DISTINCT field FROM tags").fetchall()
                      if roles.get(f, "topic") in v.roles]
            con.execute(f"CREATE VIEW topic AS SELECT * FROM tags WHERE list_contains({sql_list(fields)}, field)")
            tags_in, tagged_chunks = _count_per_tag(con, parts, fields)
            stats = Stats({"tags_in": tags_in})
            topic_rows, unique = con.execute('SELECT coalesce(sum("count"), 0), count(*) FROM per_tag').fetchone()
            stats.drop("style_field_tags", tags_in - topic_rows)
            stats.inc("unique_tags", unique)

            generic = max(v.max_chunk_share * tagged_chunks, v.generic_min_chunks)
            frequent, specific = con.execute(
                'SELECT count_if("count" >= $1), count_if("count" >= $1 AND n_chunks <= $2) FROM per_tag',
                [v.min_count, float(generic)]).fetchone()
            stats.drop("below_min_count", unique - frequent)
            stats.drop("generic_tags", frequent - specific)
            # one word outside the English lexicon, in one chunk: mostly typos, code fragments and stray strings
            # ("cabracadabrarrarrad", "segt"), which k-means gathers into junk clusters by their subwords
            con.create_function("in_lexicon", _in_lexicon, ["VARCHAR"], "BOOLEAN", type="arrow")
            con.execute("""CREATE TABLE kept AS SELECT * FROM per_tag WHERE "count" >= $1 AND n_chunks <= $2
                           AND (n_chunks > 1 OR contains(tag_norm, ' ') OR in_lexicon(tag_norm))""",
                        [v.min_count, float(generic)])
            n_kept = con.execute("SELECT count(*) FROM kept").fetchone()[0]
            stats.drop("rare_unknown_words", specific - n_kept)
            if v.min_context_specificity > 0:
                generic_in_context = self._generic_in_context(con, run, stats)
                if generic_in_context:
                    con.register("generic_in_context", pa.table({"tag_norm": generic_in_context}))
                    con.execute("DELETE FROM kept WHERE tag_norm IN (SELECT tag_norm FROM generic_in_context)")
                    con.unregister("generic_in_context")
                stats.drop("generic_in_context", len(generic_in_context))
                n_kept -= len(generic_in_context)
            stats.inc("tags_out", n_kept)
            # the spellings of kept tags, then their lists: one query doing both ran out of memory at 256 MiB
            con.execute("CREATE TABLE spellings AS SELECT DISTINCT tag_norm, tag FROM topic "
                        "SEMI JOIN kept USING (tag_norm)")
            con.execute(f"CREATE TABLE variants AS SELECT tag_norm, min(tag, {MAX_VARIANTS}) AS variants "
                        f"FROM spellings GROUP BY tag_norm")
            # a deterministic order, most frequent first (strings compare by code point, as in Python)
            con.execute("""CREATE TABLE ranked AS
                SELECT row_number() OVER (ORDER BY k."count" DESC, k.tag_norm) - 1 AS rank, k.*, v.variants
                FROM kept k JOIN variants v USING (tag_norm)""")
            pairs = SortedLists(_sorted_pairs(con, tmp), "rank", "chunk_id")
            rows = record_batches(con, 'SELECT rank, tag_norm, "count", n_chunks, fields, variants FROM ranked '
                                       "ORDER BY rank")
            self._write(run, rows, pairs, n_kept, stats)
        return stats

    def _generic_in_context(self, con, run: RunDir, stats: Stats) -> list[str]:
        """The tested tags (see the module docstring) whose context specificity is below the threshold, sorted."""
        from tqdm.auto import tqdm  # a bar inside the stage's one shard: embedding the chunks is its long step

        v = self.config.vocab
        tested = con.execute('SELECT tag_norm FROM kept WHERE n_chunks >= $1 ORDER BY n_chunks DESC, tag_norm '
                             'LIMIT $2', [v.context_min_chunks, v.context_max_tags]).fetchall()
        if not tested:
            return []
        con.register("tested", pa.table({"tag_norm": [tag for tag, in tested]}))
        chunks = f"read_parquet({sql_list(checked_parts(run, layout.CHUNKS, ['chunk_id', 'domain']))})"
        samples = con.execute(f"""SELECT s.tag_norm, s.chunk_id, c.domain FROM (
            SELECT tag_norm, chunk_id,
                   row_number() OVER (PARTITION BY tag_norm ORDER BY hash(chunk_id), chunk_id) AS pos
            FROM (SELECT DISTINCT tag_norm, chunk_id FROM topic SEMI JOIN tested USING (tag_norm))) s
            LEFT JOIN {chunks} c USING (chunk_id)
            WHERE s.pos <= {CONTEXT_SAMPLE} ORDER BY s.tag_norm, s.chunk_id""").fetchall()
        con.unregister("tested")
        background = con.execute(f"""SELECT domain, chunk_id FROM (
            SELECT domain, chunk_id, row_number() OVER (PARTITION BY domain ORDER BY hash(chunk_id), chunk_id) AS pos
            FROM {chunks} SEMI JOIN (SELECT DISTINCT chunk_id FROM topic) USING (chunk_id))
            WHERE pos <= {CONTEXT_BACKGROUND} ORDER BY domain, chunk_id""").fetchall()
        ids = sorted({chunk for _, chunk, _ in samples} | {chunk for _, chunk in background})
        with tqdm(total=len(ids), desc="vocab: embed tagged chunks", unit="chunk",
                  disable=not self.config.execution.progress) as bar:
            vectors, computed = embed_chunks(con, run, ids, self.chunk_encoder,  # a missing chunk: ArtifactError
                                             self.config.annotator.embed_batch_size, progress=bar.update)
        stats.inc("context_chunks_embedded", computed)
        vectors = vectors.astype(np.float32)
        row = {chunk: i for i, chunk in enumerate(ids)}
        by_domain: dict[str, list[int]] = {}
        for domain, chunk in background:
            by_domain.setdefault(domain, []).append(row[chunk])
        baseline = {domain: mean_pairwise_cosine(vectors[rows]) for domain, rows in by_domain.items() if len(rows) > 1}
        by_tag: dict[str, list[tuple[str, str]]] = {}
        for tag, chunk, domain in samples:
            by_tag.setdefault(tag, []).append((chunk, domain))
        stats.inc("context_tags_tested", len(by_tag))
        generic = []
        for tag, members in by_tag.items():
            score = context_specificity(vectors[[row[c] for c, _ in members]], [d for _, d in members], baseline)
            if score is not None and score < v.min_context_specificity:
                generic.append(tag)
        return sorted(generic)

    def _write(self, run: RunDir, rows, pairs: SortedLists, n_tags: int, stats: Stats) -> None:
        """Write the vocabulary part and its embeddings, one batch of tags at a time (both files or neither)."""
        with ExitStack() as files:
            part = files.enter_context(PartWriter(run.part_path(self.output, 0), VOCAB_SCHEMA, "chunk_ids"))
            embeddings = _Embeddings(self, run, n_tags, stats, files)
            for rows_batch in rows:
                for batch in (rows_batch.slice(s.start, s.stop - s.start)
                              for s in budget_slices(rows_batch.column("n_chunks").to_numpy())):
                    chunk_ids = pairs.take(batch.column("rank").to_numpy(), pa.string())
                    part.write(pa.table([batch.column(name) for name in VOCAB_SCHEMA.names[:-1]] + [chunk_ids],
                                        names=VOCAB_SCHEMA.names))
                embeddings.add(rows_batch.column("tag_norm").to_pylist())
            embeddings.add([], last=True)


def _count_per_tag(con, parts: list[Path], fields: list[str]) -> tuple[int, int]:
    """Create ``per_tag`` (tag_norm, count, n_chunks, fields) from the topic fields' tags; return the number of tag
    rows and of tagged chunks. A chunk's tags are all in its shard's part, so each part is grouped on its own (memory
    holds one part's distinct chunks, not the corpus's) and the parts' rows are then added up."""
    con.execute("CREATE TABLE per_part (tag_norm VARCHAR, count BIGINT, n_chunks BIGINT, fields VARCHAR[])")
    tags_in = tagged_chunks = 0
    for part in parts:
        con.execute(f"CREATE OR REPLACE VIEW part_tags AS SELECT chunk_id, field, tag_norm "
                    f"FROM read_parquet({sql_list([part])})")
        rows, chunks = con.execute("SELECT count(*), count(DISTINCT chunk_id) FROM part_tags").fetchone()
        tags_in, tagged_chunks = tags_in + rows, tagged_chunks + chunks
        con.execute(f"""INSERT INTO per_part SELECT tag_norm, count(chunk_id), count(DISTINCT chunk_id),
                        list(DISTINCT field) FROM part_tags WHERE list_contains({sql_list(fields)}, field)
                        GROUP BY tag_norm""")
    con.execute("""CREATE TABLE per_tag AS SELECT tag_norm, sum("count")::BIGINT AS count,
                   sum(n_chunks)::BIGINT AS n_chunks, list_sort(list_distinct(flatten(list(fields)))) AS fields
                   FROM per_part GROUP BY tag_norm""")
    con.execute("DROP TABLE per_part")
    return tags_in, tagged_chunks


def _sorted_pairs(con, tmp: Path) -> Iterator[pa.RecordBatch]:
    """(rank, chunk_id) of every kept tag and chunk it came from, by rank then chunk id. One sort of them all would
    hold a share of the corpus in memory: one pass instead splits them into ranges of ranks with about
    PAIRS_PER_PASS pairs (a partitioned COPY to Parquet, done here), and each range is sorted on its own as the
    stream is read (on a cursor of its own: the vocabulary rows stream on ``con``)."""
    con.execute(f"""CREATE TABLE rank_range AS SELECT tag_norm, rank,
                    (sum(n_chunks) OVER (ORDER BY rank) - n_chunks) // {PAIRS_PER_PASS} AS range FROM ranked""")
    n_ranges, = con.execute("SELECT coalesce(max(range) + 1, 0) FROM rank_range").fetchone()
    folder = tmp / "pairs"
    con.execute(f"""COPY (SELECT r.range, r.rank, t.chunk_id FROM topic t JOIN rank_range r USING (tag_norm))
                    TO {sql_string(folder)} (FORMAT parquet, PARTITION_BY (range))""")
    cursor = con.cursor()

    def ranges() -> Iterator[pa.RecordBatch]:
        for i in range(n_ranges):
            if (folder / f"range={i}").is_dir():  # a tag on more than PAIRS_PER_PASS chunks skips a range number
                yield from record_batches(cursor, f"""SELECT DISTINCT rank, chunk_id FROM read_parquet(
                    {sql_string(folder / f"range={i}" / "*.parquet")}) ORDER BY rank, chunk_id""")

    return ranges()


class _Embeddings:
    """The vocabulary's embeddings, computed in the fixed batches of its order (``vocab.batch_size``) as the tags
    stream by, and written to ``_embeddings.npy`` block by block."""

    def __init__(self, stage: VocabStage, run: RunDir, n_tags: int, stats: Stats, files: ExitStack):
        self.stage, self.run, self.n_tags, self.stats, self.files = stage, run, n_tags, stats, files
        self.batch = stage.config.vocab.batch_size
        self.pending: list[str] = []
        self.writer: NpyWriter | None = None

    def add(self, texts: list[str], last: bool = False) -> None:
        self.pending += texts
        whole = len(self.pending) if last else len(self.pending) - len(self.pending) % self.batch
        if whole:
            vectors, computed = encode_cached(self.stage.embedder, self.pending[:whole],
                                              self.run.root / layout.CACHE / "embeddings", self.batch)
            self.pending = self.pending[whole:]
            if computed:
                self.stats.inc("tags_embedded", computed)
            if computed < whole:
                self.stats.inc("tags_from_cache", whole - computed)
            self._writer(vectors.shape[1]).write(vectors)
        elif last:
            self._writer(self.stage.embedder.dim)  # no tags at all: an empty array of the model's width

    def _writer(self, dim: int) -> NpyWriter:
        # opened at the first block, whose width it takes: a vocabulary found in the cache never loads the model
        if self.writer is None:
            path = self.run.output_dir(self.stage.output) / "_embeddings.npy"
            self.writer = self.files.enter_context(NpyWriter(path, (self.n_tags, dim), np.float16))
        return self.writer
