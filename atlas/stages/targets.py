"""Stage ``targets`` (global): the annotator's training data (paper 4.2.3).

1. **Inherited targets.** A tagged chunk inherits the concepts of its tags, through tag -> cluster
   -> concept (``library/tag_to_concept.parquet``), for the tags of the fields the library was built
   from (``fields`` in ``library/config.json``: the topic fields). These are positives only: a concept a chunk
   did not inherit is *unlabeled*, not negative (the annotator is trained as positive-unlabeled). A tag's near
   concept (``near_concept_id``, a partial vote in the library's reading) is not a positive: it is unlabeled.
2. **Reservoir, long-tail enriched.** Going through the concepts from rarest to most common, up to
   ``annotator.min_per_concept`` chunks of each are taken first (``picked = "long_tail"``); the rest
   is a uniform fill up to ``annotator.reservoir_size`` (``"fill"``; None: every tagged chunk).
3. **Split by document.** A document's chunks all go to ``train`` or all to ``heldout``
   (``annotator.heldout_fraction``; the paper held out 597k of 2.9M chunks), so the held-out
   figures are not inflated by near-copies from the same document.
4. **Auxiliary labels** (tone, demographic reference, alignment-relevant) for every reservoir chunk
   from the finite lists in ``schemas/aux/`` (see ``atlas.models.auxiliary``): an LLM picks which apply
   (or abstains), or offline, embedding similarity calibrated against a null of neutral text. LLM answers are
   validated, retried and cached in ``RUN/_cache/aux/``; a chunk whose answers all fail keeps its content
   targets, gets no auxiliary labels and is counted (``aux_status`` says why).

    targets/part-00000.parquet   chunk_id, doc_id, domain, split, picked, concepts (all global ids),
                                 content_global_ids, <aux>_global_ids, aux_status

The joins run out of core (DuckDB over the tag and chunk parts and tag_to_concept, at most
``execution.memory_gb``, spilling to ``RUN/_tmp/targets/``). Memory holds a few bytes per tagged chunk (the
random order and the picks), one concept's chunks at a time, and ``AUX_BLOCK`` reservoir chunks at a time
(embedded, labeled, written): the reservoir's rows, texts included, go to ``RUN/_tmp/targets/`` in one pass and come
back in chunk id order a block at a time (``ByPlace``), and the offline similarities wait on disk until every chunk
has been seen, as each label is standardized over the whole reservoir. Float32 BLAS may round a block's
similarities in the last bit differently from a product of the whole matrix, so a reservoir larger than one block
can, rarely, give another label where a z-score lies within rounding of a threshold; the result is the same on
every rerun.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from atlas.config import PROJECT_ROOT
from atlas.core.extras import llm_extras
from atlas.core.files import ArtifactError, sha256_bytes, stable_hash
from atlas.core.rundir import RunDir
from atlas.core.stage import Stage
from atlas.core.stats import Stats
from atlas.io import layout
from atlas.io.library import check_tag_to_concept, inheriting_fields, load_library
from atlas.io.neutral_text import neutral_texts
from atlas.io.outofcore import (
    PartWriter,
    RowFile,
    SortedLists,
    checked_parts,
    duckdb_session,
    record_batches,
    rows_of,
    runs_of,
    scratch,
    sql_list,
)
from atlas.io.tags import tag_parts
from atlas.llm.answers import parse_answer
from atlas.llm.ask import ask_until_done
from atlas.llm.cache import RequestCache
from atlas.llm.engine import LLMRequest, LLMResult, make_tag_engine
from atlas.llm.prompts import load_prompt
from atlas.models.auxiliary import (
    answer_schema,
    calibrated_labels,
    chosen_labels,
    configured_domains,
    describe_lists,
    list_hashes,
    null_thresholds,
    reads_like_null,
)
from atlas.models.embedder import Embedder, encode_cached

TARGETS_VERSION = 4
AUX_PROMPT = {"system": set(), "user": {"lists", "text"}, "repair": {"problem", "field_names"}}
AUX_BLOCK = 32_768  # reservoir chunks embedded, labeled and written at a time (~50 MB of float32 embeddings)
SPILL_ROWS = 8_192  # reservoir rows (with their texts: ~8 MB) taken from the join at a time
SPILL_FILE_ROWS = AUX_BLOCK  # reservoir rows per spill file: reading one back holds a block's rows
LONG_TAIL, FILL = 1, 2  # how a chunk entered the reservoir (0: it did not)
PICKED = {LONG_TAIL: "long_tail", FILL: "fill"}


def targets_schema(aux_domains: list[str]) -> pa.Schema:
    ids = pa.list_(pa.int64())
    return pa.schema(
        [("chunk_id", pa.string()), ("doc_id", pa.string()), ("domain", pa.string()), ("split", pa.string()),
         ("picked", pa.string()), ("concepts", ids), ("content_global_ids", ids)]
        + [(f"{d}_global_ids", ids) for d in aux_domains] + [("aux_status", pa.string())]
    )


def reservoir_picks(n: int, members_by_concept: Iterable[tuple[int, np.ndarray]], size: int | None,
                    min_per_concept: int, seed: int) -> np.ndarray:
    """How each of the chunks 0..n-1 entered the reservoir: 0 (it did not), LONG_TAIL or FILL.

    ``members_by_concept``: (concept, its chunks), rarest concept first (fewest chunks, then the smaller id). In one
    seeded random order of all chunks, up to ``min_per_concept`` chunks of each concept are taken (counting chunks
    already taken), then a uniform fill in the same order up to ``size`` (None: all). Memory: 17 bytes a chunk (the
    order, each chunk's place in it, the picks) and one concept's chunks at a time."""
    order = np.random.default_rng(seed).permutation(n)
    place = np.empty(n, dtype=np.int64)
    place[order] = np.arange(n)
    size = n if size is None else min(size, n)
    picked = np.zeros(n, dtype=np.uint8)
    taken = 0
    for _, members in members_by_concept:
        members = members[np.argsort(place[members], kind="stable")]  # the concept's chunks in the random order
        free = members[picked[members] == 0]
        need = min(min_per_concept - (len(members) - len(free)), size - taken)
        if need > 0:
            picked[free[:need]] = LONG_TAIL
            taken += len(free[:need])
    if taken < size:
        picked[order[picked[order] == 0][: size - taken]] = FILL
    return picked


def build_reservoir(chunk_ids: list[str], concepts: dict[str, list[int]], size: int | None, min_per_concept: int,
                    seed: int) -> dict[str, str]:
    """``reservoir_picks`` on lists in memory: chunk id -> "long_tail" or "fill" (``concepts``: a chunk's concept
    ids)."""
    index = {chunk: i for i, chunk in enumerate(chunk_ids)}
    members: dict[int, list[int]] = {}
    for chunk, ids in concepts.items():
        for concept in ids if chunk in index else ():
            members.setdefault(concept, []).append(index[chunk])
    rarest_first = sorted(members.items(), key=lambda kv: (len(kv[1]), kv[0]))
    picked = reservoir_picks(len(chunk_ids), ((c, np.array(m, dtype=np.int64)) for c, m in rarest_first), size,
                             min_per_concept, seed)
    return {chunk_ids[i]: PICKED[int(picked[i])] for i in np.flatnonzero(picked)}


def list_array(lists: list[list[int]], offset: int) -> pa.ListArray:
    """Python lists of ints, each value plus ``offset``, as an Arrow list<int64> array."""
    lengths = np.fromiter(map(len, lists), np.int64, len(lists))
    values = np.fromiter(chain.from_iterable(lists), np.int64, int(lengths.sum())) + offset
    return pa.ListArray.from_arrays(pa.array(np.append(0, np.cumsum(lengths)), pa.int32()), pa.array(values))


def sorted_union(arrays: Iterable[pa.ListArray]) -> pa.ListArray:
    """Row by row, the values of all the list arrays (of equal length) together, sorted."""
    arrays = list(arrays)
    rows = np.concatenate([pc.list_parent_indices(x).to_numpy() for x in arrays])
    values = np.concatenate([pc.list_flatten(x).to_numpy() for x in arrays]).astype(np.int64)
    order = np.lexsort((values, rows))
    lengths = np.bincount(rows, minlength=len(arrays[0]))
    return pa.ListArray.from_arrays(pa.array(np.append(0, np.cumsum(lengths)), pa.int32()), pa.array(values[order]))


class ByPlace:
    """Rows that arrive in any order, each with its place in the output (``place``: 0 .. n-1), read back in place
    order: one pass spreads them over Arrow files of ``rows`` consecutive places each, then ``read`` sorts one file
    at a time. Memory holds one file's rows, where a sort of them all would hold every row (texts, here).

    Use as a context manager for the writing; ``problem`` is the error when places are missing or repeated."""

    MAX_FILES = 256  # open at once while writing (well within the usual limit of 1,024): more rows per file beyond

    def __init__(self, folder: Path, n: int, rows: int, schema: pa.Schema, problem: str):
        self.rows = rows * max(1, -(-n // (rows * self.MAX_FILES)))
        self.n, self.schema, self.problem, self.written = n, schema, problem, 0
        folder.mkdir(parents=True, exist_ok=True)
        self.paths = [folder / f"{i:05d}.arrow" for i in range(-(-n // self.rows))]
        self.writers: list = []

    def __enter__(self) -> ByPlace:
        self.writers = [pa.ipc.new_file(str(path), self.schema) for path in self.paths]
        return self

    def write(self, batch: pa.RecordBatch) -> None:
        file = batch.column("place").to_numpy() // self.rows
        order = np.argsort(file, kind="stable")
        batch, bounds = batch.take(pa.array(order)), np.searchsorted(file[order], np.arange(len(self.paths) + 1))
        for i in np.flatnonzero(np.diff(bounds)):
            self.writers[i].write_batch(batch.slice(bounds[i], bounds[i + 1] - bounds[i]))
        self.written += batch.num_rows

    def __exit__(self, kind, error, trace) -> None:
        for writer in self.writers:
            writer.close()

    def read(self, columns: list[str]) -> Iterator[pa.RecordBatch]:
        """The ``columns`` of the rows in place order, a file at a time."""
        for i, path in enumerate(self.paths):
            with pa.memory_map(str(path)) as source:  # the columns not asked for are not read
                table = pa.ipc.open_file(source).read_all()
                place = table.column("place").to_numpy()
                order = np.argsort(place)
                start = i * self.rows
                if not np.array_equal(place[order], np.arange(start, min(start + self.rows, self.n))):
                    raise ArtifactError(self.problem)
                yield from table.select(columns).take(pa.array(order)).to_batches()


def heldout_split(doc_id: str, fraction: float, seed: int) -> str:
    """"heldout" for a stable ``fraction`` of documents, whatever the order or sharding."""
    return "heldout" if int(stable_hash([seed, doc_id])[:8], 16) / 16**8 < fraction else "train"


class TargetsStage(Stage):
    name = "targets"
    output = layout.TARGETS
    upstream = ("tag", "library")
    needs = ("embed",)

    def extras(self) -> tuple[str, ...]:
        return self.needs + llm_extras(self.config.llm.engine)

    def identity(self) -> dict:
        a = self.config.annotator
        identity = {"version": TARGETS_VERSION, "seed": a.seed, "reservoir_size": a.reservoir_size,
                    "min_per_concept": a.min_per_concept, "heldout_fraction": a.heldout_fraction,
                    "aux_files": list_hashes(configured_domains(self.config))}
        if self.config.llm.engine == "offline":
            return identity | {"aux": "offline", "embedding_model": self.config.tag.embedding_model,
                               "min_z": a.aux_min_z, "min_similarity": a.aux_min_similarity,
                               "null_quantile": a.aux_null_quantile, "null_nearest": a.aux_null_nearest,
                               "null_sha256": stable_hash(list(neutral_texts())), "batch": a.embed_batch_size}
        prompt = load_prompt(PROJECT_ROOT / "prompts" / "aux.yaml", AUX_PROMPT)
        return identity | {"aux": make_tag_engine(self.config).identity(), "prompt_sha256": prompt.sha256,
                           "max_attempts": self.config.tag.max_attempts}

    def setup(self) -> None:
        # Auxiliary labels: offline, embedding similarity to each label; otherwise the tag stage's engine.
        if self.config.llm.engine == "offline":
            self.embedder, self.engine = Embedder(self.config.tag.embedding_model), None
        else:
            self.embedder, self.engine = None, make_tag_engine(self.config)
            self.engine.setup()

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.close()

    def run_shard(self, run: RunDir, shard: int) -> Stats:
        a = self.config.annotator
        _, library = load_library(run)
        domains = configured_domains(self.config)
        offsets = library["domain_offsets"]
        if missing := [d.name for d in domains if d.name not in offsets]:
            raise ValueError(f"{run.output_dir(layout.LIBRARY)}/config.json has no offsets for auxiliary domains "
                             f"{missing}; rebuild the library (atlas run CONFIG --force --stages library)")
        check_tag_to_concept(run, library["domain_sizes"]["content"])
        tags = tag_parts(run)
        chunks = checked_parts(run, layout.CHUNKS, ["chunk_id", "doc_id", "domain", "chunk_text"])
        mapping = run.output_dir(layout.LIBRARY) / "tag_to_concept.parquet"
        fields = inheriting_fields(library)  # the topic fields: a style tag inherits no content concept
        tmp = run.output_dir(layout.TMP) / self.name  # spill files, removed after
        with scratch(tmp), duckdb_session(tmp, self.config.execution.memory_gb) as con:
            con.execute(f"CREATE VIEW tags AS SELECT chunk_id, field, tag_norm FROM read_parquet({sql_list(tags)})")
            con.execute(f"CREATE VIEW chunks AS SELECT chunk_id, doc_id, domain, chunk_text "
                        f"FROM read_parquet({sql_list(chunks)})")
            # the tagged chunks, numbered in chunk id order, and the content concepts their tags map to
            con.execute("CREATE TABLE tagged AS SELECT chunk_id, row_number() OVER (ORDER BY chunk_id) - 1 AS idx "
                        "FROM (SELECT DISTINCT chunk_id FROM tags)")
            con.execute(f"""CREATE TABLE content AS SELECT DISTINCT g.idx, m.concept_id AS concept
                            FROM tags t JOIN read_parquet({sql_list([mapping])}) m USING (tag_norm)
                            JOIN tagged g USING (chunk_id) WHERE m.concept_id IS NOT NULL
                            {"" if fields is None else f"AND list_contains({sql_list(fields)}, t.field)"}""")
            n, = con.execute("SELECT count(*) FROM tagged").fetchone()
            with_concepts, = con.execute("SELECT count(DISTINCT idx) FROM content").fetchone()
            stats = Stats({"chunks_tagged": n, "chunks_with_concepts": with_concepts})
            members = runs_of(record_batches(con, """
                SELECT c.concept, c.idx FROM content c JOIN (SELECT concept, count(*) AS size FROM content
                GROUP BY concept) s USING (concept) ORDER BY s.size, c.concept"""), "concept", "idx")
            picked = reservoir_picks(n, members, a.reservoir_size, a.min_per_concept, a.seed)
            chosen = np.flatnonzero(picked)  # increasing: a chunk's place in the output is its rank here
            con.register("chosen_rows", pa.table({"idx": chosen, "picked": picked[chosen],
                                                  "place": np.arange(len(chosen))}))
            con.execute("CREATE TABLE chosen AS SELECT * FROM chosen_rows")
            con.unregister("chosen_rows")
            stats.inc("reservoir", len(chosen))
            stats.inc("reservoir_long_tail", int((picked == LONG_TAIL).sum()))
            del picked, chosen
            stats.inc("concepts_below_min_per_concept", con.execute(
                "SELECT count(*) FROM (SELECT concept FROM content WHERE idx IN (SELECT idx FROM chosen) "
                "GROUP BY concept HAVING count(*) < ?)", [a.min_per_concept]).fetchone()[0])
            reservoir = self._reservoir(run, con, tmp, stats["reservoir"])
            con.execute("DROP TABLE tagged")
            texts = reservoir.read(["chunk_id", "chunk_text"])
            aux = (self._aux_offline(run, tmp, domains, texts, stats) if self.config.llm.engine == "offline"
                   else self._aux_llm(run, domains, texts, stats))
            self._write(run, con, domains, offsets, aux, reservoir, stats)
        return stats

    def _reservoir(self, run: RunDir, con, tmp, size: int) -> ByPlace:
        """The reservoir's rows (with their texts) on disk, to be read in chunk id order: sorting every text in
        memory would hold the whole reservoir's."""
        problem = (f"{run.output_dir(layout.CHUNKS)}: {{}} tagged chunk(s) are not in the chunk parts, or are there "
                   "twice; recompute the chunk stage")
        rows = con.execute("SELECT c.place, c.idx, c.picked, g.chunk_id, k.doc_id, k.domain, k.chunk_text "
                           "FROM chosen c JOIN tagged g USING (idx) JOIN chunks k USING (chunk_id)"
                           ).to_arrow_reader(SPILL_ROWS)
        with ByPlace(tmp / "reservoir", size, SPILL_FILE_ROWS, rows.schema, problem.format("some")) as reservoir:
            for batch in rows:
                reservoir.write(batch)
        if reservoir.written != size:
            raise ArtifactError(problem.format(size - reservoir.written))
        return reservoir

    def _write(self, run: RunDir, con, domains, offsets: dict, aux: Iterator, reservoir: ByPlace,
               stats: Stats) -> None:
        """The reservoir's rows in chunk id order, a block at a time: ``aux`` gives each block's auxiliary labels."""
        a = self.config.annotator
        rows_in = rows_of(reservoir.read(["idx", "picked", "chunk_id", "doc_id", "domain"]), AUX_BLOCK)
        content = SortedLists(record_batches(con, "SELECT idx, concept FROM content WHERE idx IN "
                                                  "(SELECT idx FROM chosen) ORDER BY idx, concept"), "idx", "concept")
        schema = targets_schema([d.name for d in domains])
        picked_names = pa.array([None, PICKED[LONG_TAIL], PICKED[FILL]], pa.string())  # by the picked code
        positives = dict.fromkeys(["content"] + [d.name for d in domains], 0)
        splits = {"train": 0, "heldout": 0}
        with PartWriter(run.part_path(self.output, 0), schema) as part:
            for (labels, status), block in zip(aux, rows_in):
                ids = {"content": content.take(block.column("idx").to_numpy(), pa.int64())}
                ids |= {d.name: list_array(labels[d.name], offsets[d.name]) for d in domains}
                # the split is a document's: decided once per document of the block
                docs = pc.dictionary_encode(block.column("doc_id").combine_chunks(), null_encoding="encode")
                split = pa.array([heldout_split(doc, a.heldout_fraction, a.seed)
                                  for doc in docs.dictionary.to_pylist()], pa.string()).take(docs.indices)
                columns = {"chunk_id": block.column("chunk_id"), "doc_id": block.column("doc_id"),
                           "domain": block.column("domain"), "split": split,
                           "picked": picked_names.take(block.column("picked")), "concepts": sorted_union(ids.values()),
                           "content_global_ids": ids["content"]}
                columns |= {f"{d.name}_global_ids": ids[d.name] for d in domains}
                part.write(pa.table(columns | {"aux_status": pa.array(status, pa.string())}, schema=schema))
                heldout = pc.sum(pc.equal(split, "heldout")).as_py() or 0
                splits["heldout"] += heldout
                splits["train"] += len(split) - heldout
                for domain, lists in ids.items():
                    positives[domain] += len(pc.list_flatten(lists))
        stats.inc("train", splits["train"])
        stats.inc("heldout", splits["heldout"])
        for domain, count in positives.items():
            stats.inc(f"positives_{domain}", count)

    def _bar(self, total: int, desc: str, unit: str):
        """A progress bar inside the stage's one shard (the runner's bar shows shards: 0/1 until the end)."""
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit=unit, disable=not self.config.execution.progress)

    def _aux_offline(self, run: RunDir, tmp, domains, texts: Iterator, stats: Stats) -> Iterator:
        """Embedding similarity between each chunk and each label's "name: description", calibrated against the
        null (see ``atlas.models.auxiliary``). Every block's similarities go to disk first, as each label is
        standardized over the whole reservoir; then the labels, by block."""
        a = self.config.annotator
        embedder, cache = self.embedder, run.root / layout.CACHE / "embeddings"
        labels = {d.name: encode_cached(embedder, d.texts, cache)[0].astype(np.float32) for d in domains}
        null = encode_cached(embedder, list(neutral_texts()), cache, a.embed_batch_size)[0].astype(np.float32)
        thresholds = {d.name: null_thresholds(null @ labels[d.name].T, d, a.aux_null_quantile,
                                              a.aux_min_similarity) for d in domains}
        stats.inc("null_texts", len(null))
        similarity = {d.name: RowFile(tmp / f"similarity_{d.name}.f32", len(d.labels)) for d in domains}
        like_null = RowFile(tmp / "like_null.f32", 1)
        block = -(-AUX_BLOCK // a.embed_batch_size) * a.embed_batch_size  # whole batches: the cache's unit
        stats.inc("chunks_embedded", 0)
        n = 0
        with self._bar(stats["reservoir"], "targets: embed reservoir", "chunk") as bar:
            for rows in rows_of(texts, block):
                vectors, computed = encode_cached(embedder, rows.column("chunk_text").to_pylist(), cache,
                                                  a.embed_batch_size, progress=bar.update)
                stats.inc("chunks_embedded", computed)
                n += rows.num_rows
                chunk_vectors = vectors.astype(np.float32)
                for d in domains:
                    similarity[d.name].append(chunk_vectors @ labels[d.name].T)
                like_null.append(reads_like_null(chunk_vectors, null, a.aux_null_nearest)[:, None].astype(np.float32))
        column_stats = {d.name: similarity[d.name].column_stats() for d in domains}
        for start in range(0, n, AUX_BLOCK):
            neutral = like_null.read(start, AUX_BLOCK)[:, 0] > 0
            stats.inc("aux_like_null", int(neutral.sum()))
            aux = {d.name: [[j for j, _ in chosen] for chosen in calibrated_labels(
                similarity[d.name].read(start, AUX_BLOCK), d, a.aux_min_z, thresholds[d.name],
                column_stats[d.name], neutral)] for d in domains}
            yield aux, ["offline"] * min(AUX_BLOCK, n - start)

    def _aux_llm(self, run: RunDir, domains, texts: Iterator, stats: Stats) -> Iterator:
        """An LLM picks labels from the lists, ``AUX_BLOCK`` chunks at a time (see ``_aux_llm_block``)."""
        for rows in rows_of(texts, AUX_BLOCK):
            yield self._aux_llm_block(run, domains, rows.column("chunk_id").to_pylist(),
                                      rows.column("chunk_text").to_pylist(), stats)

    def _aux_llm_block(self, run: RunDir, domains, chunk_ids: list[str], texts: list[str], stats: Stats):
        """An LLM picks labels from the lists; validated, retried up to tag.max_attempts, cached."""
        prompt = load_prompt(PROJECT_ROOT / "prompts" / "aux.yaml", AUX_PROMPT)
        schema, lists, engine = answer_schema(domains), describe_lists(domains), self.engine
        answers: dict[int, dict] = {}
        status = ["failed"] * len(texts)

        def request(i: int, attempt: int, problem: str | None) -> LLMRequest:
            user = prompt.render("user", lists=lists, text=texts[i])
            if problem:  # a second chance, told what was wrong
                user += "\n\n" + prompt.render("repair", problem=problem, field_names=", ".join(schema.fields))
            return LLMRequest(f"{chunk_ids[i]}#{attempt}", prompt.templates["system"], user, schema.schema,
                              "aux_labels", {"task": "aux"})

        def check(i: int, attempt: int, result: LLMResult) -> str | None:
            parsed = parse_answer(result.text, result.finish_reason, schema) if not result.error else None
            if parsed is not None and parsed.answer is not None:
                answers[i], status[i] = parsed.answer, "ok"
                return None
            status[i] = f"failed:{result.error or parsed.problem}"
            if attempt == self.config.tag.max_attempts:
                return None
            return result.error or f"{parsed.problem}: {parsed.detail}"

        cache = RequestCache(run.root / layout.CACHE / "aux" / f"{sha256_bytes(lists.encode())[:12]}.jsonl",
                             engine.identity())
        try:
            counters = ask_until_done(engine, cache, len(texts), request, check, self.config.tag.batch_size)
        finally:
            cache.close()
        stats.merge({f"aux_{name}": n for name, n in counters.items() if n})
        stats.inc("aux_failed", sum(s != "ok" for s in status))
        position = {d.name: {name: j for j, name in enumerate(d.names)} for d in domains}
        aux = {d.name: [[position[d.name][n] for n in chosen_labels(answers.get(i, {}).get(d.name, []))]
                        for i in range(len(texts))] for d in domains}
        stats.inc("aux_abstained", sum(chosen_labels(answers[i][d.name]) == [] for i in answers for d in domains))
        return aux, status
