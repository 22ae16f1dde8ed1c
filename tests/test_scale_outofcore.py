"""Out-of-core global stages (issue 16): the streamed writers, the DuckDB groupings and the reservoir give the same
bytes as the in-memory code they replaced, which is kept here as the reference."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from atlas.config import config_from_dict
from atlas.core.files import atomic_write_npy, atomic_write_parquet
from atlas.core.rundir import RunDir
from atlas.io import outofcore
from atlas.io.outofcore import NpyWriter, PartWriter, RowFile, SortedLists, duckdb_session, runs_of, scratch
from atlas.io.tags import TAG_SCHEMA, VOCAB_SCHEMA
from atlas.stages.targets import build_reservoir


def random_vocab(n: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    rows = [{"tag_norm": f"tag {i} é", "count": int(rng.integers(1, 9)), "n_chunks": i % 7, "fields": ["main"],
             "variants": ["A", "b"][: i % 3], "chunk_ids": [f"d{rng.integers(10**6)}:{j:05d}" for j in range(i % 6)]}
            for i in range(n)]
    return pa.Table.from_pylist(rows, schema=VOCAB_SCHEMA)


@pytest.mark.parametrize("n", [0, 7, 64_000, 130_001])
def test_part_writer_gives_the_bytes_of_a_whole_table_write(tmp_path, n):
    table = random_vocab(n)
    atomic_write_parquet(tmp_path / "whole.parquet", table)
    with PartWriter(tmp_path / "streamed.parquet", VOCAB_SCHEMA, "chunk_ids") as writer:
        for start in range(0, n, 9_999):  # batches that cut across row groups
            writer.write(table.slice(start, 9_999))
    assert (tmp_path / "streamed.parquet").read_bytes() == (tmp_path / "whole.parquet").read_bytes()
    assert [p.name for p in tmp_path.iterdir()] != [] and not list(tmp_path.glob(".*.tmp"))


def test_part_writer_ends_a_row_group_before_the_list_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(outofcore, "MAX_LIST_VALUES", 10)
    table = random_vocab(40)  # 0-5 chunk ids a row
    with PartWriter(tmp_path / "part.parquet", VOCAB_SCHEMA, "chunk_ids") as writer:
        writer.write(table)
    meta = pq.read_metadata(tmp_path / "part.parquet")
    lengths = [len(x) for x in table.column("chunk_ids").to_pylist()]
    start = 0
    for g in range(meta.num_row_groups):
        rows = meta.row_group(g).num_rows
        assert sum(lengths[start : start + rows]) <= 10 or rows == 1
        start += rows
    assert meta.num_row_groups > 1 and pq.read_table(tmp_path / "part.parquet").equals(table)


def test_a_failed_write_leaves_no_file(tmp_path):
    with pytest.raises(RuntimeError), PartWriter(tmp_path / "part.parquet", VOCAB_SCHEMA) as writer:
        writer.write(random_vocab(3))
        raise RuntimeError("killed")
    with pytest.raises(RuntimeError), NpyWriter(tmp_path / "x.npy", (4, 2), np.float16) as writer:
        writer.write(np.zeros((3, 2), np.float16))  # one row short
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("shape", [(0, 5), (1_000, 384), (70_001, 3)])
def test_npy_writer_gives_the_bytes_of_np_save(tmp_path, shape):
    array = np.random.default_rng(1).standard_normal(shape).astype(np.float16)
    atomic_write_npy(tmp_path / "whole.npy", array)
    with NpyWriter(tmp_path / "streamed.npy", shape, np.float16) as writer:
        for start in range(0, shape[0], 4_097):
            writer.write(array[start : start + 4_097])
    assert (tmp_path / "streamed.npy").read_bytes() == (tmp_path / "whole.npy").read_bytes()


@pytest.mark.parametrize("shape", [(100_003, 1), (100_003, 2), (9_999, 38), (140_000, 80)])
def test_column_stats_of_blocks_are_numpy_bits(tmp_path, shape):
    """The offline auxiliary labels standardize each label over all chunks: the blockwise mean and standard
    deviation must be the bits numpy gives for the whole matrix (blocks of 65,536 rows here)."""
    matrix = (np.random.default_rng(2).standard_normal(shape) * 0.1 + 0.3).astype(np.float32)
    rows = RowFile(tmp_path / "m.f32", shape[1])
    for start in range(0, shape[0], 30_000):
        rows.append(matrix[start : start + 30_000])
    mean, std = rows.column_stats()
    assert np.array_equal(mean, matrix.mean(axis=0)) and np.array_equal(std, matrix.std(axis=0))
    assert np.array_equal(rows.read(5, 7), matrix[5:12])


def batches(keys, values, size):
    table = pa.table({"key": pa.array(keys, pa.int64()), "value": values})
    return table.to_batches(max_chunksize=size)


def test_runs_and_lists_follow_keys_across_batches():
    keys = [0, 0, 0, 2, 2, 5, 6, 6, 6, 6, 9]
    values = [f"v{i}" for i in range(len(keys))]
    for size in (1, 2, 4, 100):
        runs = [(k, v.tolist()) for k, v in runs_of(batches(keys, np.arange(len(keys)), size), "key", "value")]
        assert runs == [(0, [0, 1, 2]), (2, [3, 4]), (5, [5]), (6, [6, 7, 8, 9]), (9, [10])]
        lists = SortedLists(batches(keys, values, size), "key", "value")
        first = lists.take(np.arange(0, 4), pa.string()).to_pylist()
        second = lists.take(np.array([5, 7, 9]), pa.string()).to_pylist()  # 6 skipped: its values are dropped
        assert first == [["v0", "v1", "v2"], [], ["v3", "v4"], []] and second == [["v5"], [], ["v10"]]


def old_build_reservoir(chunk_ids, concepts, size, min_per_concept, seed):
    """The reservoir rule as the targets stage had it, in Python objects (the reference)."""
    order = [chunk_ids[i] for i in np.random.default_rng(seed).permutation(len(chunk_ids))]
    size = len(order) if size is None else min(size, len(order))
    members: dict[int, list[str]] = {}
    for chunk in order:
        for concept in concepts.get(chunk, []):
            members.setdefault(concept, []).append(chunk)
    picked: dict[str, str] = {}
    for concept in sorted(members, key=lambda c: (len(members[c]), c)):
        have = sum(chunk in picked for chunk in members[concept])
        for chunk in members[concept]:
            if have >= min_per_concept or len(picked) >= size:
                break
            if chunk not in picked:
                picked[chunk] = "long_tail"
                have += 1
    for chunk in order:
        if len(picked) >= size:
            break
        picked.setdefault(chunk, "fill")
    return picked


@pytest.mark.parametrize("size, min_per_concept", [(None, 3), (500, 5), (40, 2), (3_000, 50)])
def test_reservoir_picks_the_chunks_the_in_memory_rule_picked(size, min_per_concept):
    rng = np.random.default_rng(3)
    chunks = sorted(f"doc{i // 7}:{i % 7:05d}" for i in range(2_000))
    concepts = {c: sorted(set(rng.zipf(1.6, rng.integers(0, 5)).tolist())) for c in chunks}
    assert build_reservoir(chunks, concepts, size, min_per_concept, 7) == old_build_reservoir(
        chunks, concepts, size, min_per_concept, 7)


# --- the vocab stage against its in-memory grouping ----------------------------------------------------------


class HashEmbedder:
    model_name = "test-hash-embedder"
    dim = 8

    def encode(self, texts):
        vectors = np.array([[(hash(t) >> s) % 97 + 1 for s in range(8)] for t in texts], dtype=np.float32)
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def old_vocab_table(tags: pa.Table, config) -> pa.Table:
    """The vocab stage's grouping as it was: the whole table in memory, one Python dict per tag (the reference)."""
    import pyarrow.compute as pc

    from atlas.llm.answers import field_roles, load_schemas
    from atlas.llm.offline import in_lexicon

    v = config.vocab
    tagged_chunks = len(pc.unique(tags.column("chunk_id")))
    roles = field_roles(load_schemas(config.tag)[0])
    fields = [f for f in pc.unique(tags.column("field")).to_pylist() if roles.get(f, "topic") in v.roles]
    tags = tags.filter(pc.is_in(tags.column("field"), pa.array(fields, pa.string())))
    grouped = tags.group_by("tag_norm").aggregate(
        [("chunk_id", "count"), ("chunk_id", "distinct"), ("field", "distinct"), ("tag", "distinct")])
    rows = [{"tag_norm": r["tag_norm"], "count": r["chunk_id_count"], "n_chunks": len(r["chunk_id_distinct"]),
             "fields": sorted(r["field_distinct"]), "variants": sorted(r["tag_distinct"])[:5],
             "chunk_ids": sorted(r["chunk_id_distinct"])} for r in grouped.to_pylist()]
    kept = [r for r in rows if r["count"] >= v.min_count]
    kept = [r for r in kept if r["n_chunks"] <= max(v.max_chunk_share * tagged_chunks, v.generic_min_chunks)]
    kept = [r for r in kept if r["n_chunks"] > 1 or " " in r["tag_norm"] or in_lexicon(r["tag_norm"])]
    kept.sort(key=lambda r: (-r["count"], r["tag_norm"]))
    return pa.Table.from_pylist(kept, schema=VOCAB_SCHEMA)


def synthetic_tags(n_rows: int, n_chunks: int, seed: int = 4) -> pa.Table:
    """Tag rows with a long tail (unknown words, phrases), spelling variants, non-ASCII tags and style fields."""
    rng = np.random.default_rng(seed)
    words = ["python", "matrix", "zqxv", "über", "naïve bayes", "Ω-limit", "segt", "data", "graph theory", "ça"]
    ranks = np.where(rng.random(n_rows) < 0.4, rng.integers(10, 10**7, n_rows), rng.zipf(1.3, n_rows))
    norm = [f"{words[r % len(words)]} {r // len(words)}" if r >= len(words) and r % 3 else
            words[r % len(words)] + ("" if r < len(words) else f"{r}") for r in ranks.tolist()]
    tag = [t.upper() if i % 11 == 0 else t for i, t in enumerate(norm)]
    fields = rng.choice(["main", "minor", "purpose", "tone", "algorithm"], n_rows).tolist()
    chunks = [f"doc{c // 5:06d}:{c % 5:05d}" for c in rng.integers(0, n_chunks, n_rows).tolist()]
    return pa.table([chunks, fields, tag, norm, pa.array(np.zeros(n_rows, np.int16))], schema=TAG_SCHEMA)


def synthetic_run(tmp_path, parts: list[pa.Table], **sections) -> tuple[RunDir, object]:
    run = RunDir(tmp_path / "run")
    for i, part in enumerate(parts):
        run.part_path("tags", i).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(part, run.part_path("tags", i))
    config = config_from_dict({"name": "t", "run_dir": str(run.root), **sections})
    run.write_manifest({"config": config.model_dump(),
                        "stages": {"tag": {"output": "tags", "num_shards": len(parts), "hash": "h"}}})
    return run, config


@pytest.mark.parametrize("vocab,pairs_per_pass", [
    ({"min_count": 1}, None),
    ({"min_count": 2, "max_chunk_share": 0.01, "batch_size": 100}, 5_000),  # the (tag, chunk) pairs in ~60 ranges
    ({"min_count": 1}, 2_000),  # the top tags are on more chunks than a range holds: range numbers are skipped
])
def test_vocab_stage_writes_what_the_in_memory_grouping_wrote(tmp_path, monkeypatch, vocab, pairs_per_pass):
    pytest.importorskip("lemminflect")
    import atlas.stages.vocab as vocab_stage
    from atlas.models.embedder import encode_cached
    from atlas.stages.vocab import VocabStage

    if pairs_per_pass:
        monkeypatch.setattr(vocab_stage, "PAIRS_PER_PASS", pairs_per_pass)
    tags = synthetic_tags(400_000, 40_000)
    # as the tag stage writes them: a chunk's tags in its shard's part (vocab groups each part on its own)
    tags = tags.take(pa.compute.sort_indices(tags, [("chunk_id", "ascending")]))
    chunk_ids = tags.column("chunk_id").to_numpy(zero_copy_only=False)
    cuts = [int(np.searchsorted(chunk_ids, chunk_ids[i])) for i in range(0, tags.num_rows, 100_000)]
    parts = [tags.slice(a, b - a) for a, b in zip(cuts, cuts[1:] + [tags.num_rows])]
    # no chunks behind these tags to test their context: the grouping alone is compared
    run, config = synthetic_run(tmp_path, parts, vocab=vocab | {"min_context_specificity": 0},
                                execution={"memory_gb": 0.25})
    stage = VocabStage(config)
    stage.embedder = HashEmbedder()
    stats = stage.run_shard(run, 0).to_dict()

    expected = old_vocab_table(tags, config)
    assert expected.num_rows > 64_000 or vocab["min_count"] > 1  # more than one row group at min_count 1
    atomic_write_parquet(tmp_path / "expected.parquet", expected)
    assert run.part_path("tag_vocab", 0).read_bytes() == (tmp_path / "expected.parquet").read_bytes()
    vectors, _ = encode_cached(HashEmbedder(), expected.column("tag_norm").to_pylist(), tmp_path / "cache",
                               config.vocab.batch_size)
    atomic_write_npy(tmp_path / "expected.npy", vectors)
    assert (run.output_dir("tag_vocab") / "_embeddings.npy").read_bytes() == (tmp_path / "expected.npy").read_bytes()
    assert stats["tags_in"] == tags.num_rows and stats["tags_out"] == expected.num_rows
    assert not (run.root / "_tmp").exists()  # the spill folder goes when the stage ends


# --- lift against CountVectorizer --------------------------------------------------------------------------------


def old_lifted_words(chunk_texts, members, min_support, top=10):
    """Lift as the library stage computed it: a chunks x words matrix in memory (the reference)."""
    from scipy import sparse
    from sklearn.feature_extraction.text import CountVectorizer

    vectorizer = CountVectorizer(binary=True, stop_words="english", token_pattern=r"(?u)\b[a-zA-Z][a-zA-Z]{2,}\b")
    words = vectorizer.fit_transform(chunk_texts).tocsc()
    vocabulary = vectorizer.get_feature_names_out()
    p_word = np.asarray(words.sum(axis=0)).ravel() / len(chunk_texts)
    rows = np.concatenate([np.full(len(m), i) for i, m in enumerate(members)])
    cols = np.concatenate(members)
    membership = sparse.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(members), len(chunk_texts)))
    in_concept = (membership @ words).toarray()
    out = []
    for i, chunks in enumerate(members):
        counts = in_concept[i]
        lift = np.where(counts >= min_support, (counts / max(len(chunks), 1)) / np.maximum(p_word, 1e-12), 0)
        best = [j for j in np.lexsort((vocabulary, -counts, -lift))[:top] if lift[j] > 1]
        out.append([str(vocabulary[j]) for j in best])
    return out


def test_lifted_words_are_those_of_the_in_memory_matrix(tmp_path):
    pytest.importorskip("sklearn")
    from atlas.stages.library import lifted_words

    rng = np.random.default_rng(5)
    vocabulary = ["alpha", "beta", "gamma", "delta", "kernel", "python", "matrix", "café", "naïve", "theorem",
                  "the", "and", "Graph", "LIMIT", "x1y", "ab"]
    texts = [" ".join(rng.choice(vocabulary, rng.integers(3, 30))) for _ in range(3_000)]
    members = [np.unique(rng.choice(len(texts), rng.integers(1, 400))) for _ in range(60)]
    expected = old_lifted_words(texts, members, min_support=3)
    with scratch(tmp_path / "tmp"), duckdb_session(tmp_path / "tmp", 0.5) as con:
        con.register("pairs", pa.table({"concept": np.concatenate([np.full(len(m), i) for i, m in enumerate(members)]),
                                        "idx": np.concatenate(members)}))
        con.execute("CREATE TABLE covered AS SELECT * FROM pairs")
        stream = pa.table({"idx": np.arange(len(texts)), "chunk_text": texts}).to_batches(max_chunksize=700)
        lifted = lifted_words(con, stream, min_support=3, spill=tmp_path / "tmp")
    assert [lifted.get(i, []) for i in range(len(members))] == expected
    assert sum(map(len, expected)) > 100


# --- export against its in-memory reverse index ------------------------------------------------------------------


def test_export_field_guide_is_the_in_memory_grouping(tmp_path, monkeypatch):
    from atlas.tools.export import FIELD_GUIDE_SCHEMA, export_release

    n_concepts, rng = 5_000, np.random.default_rng(6)
    run = RunDir(tmp_path / "run")
    library = run.output_dir("library")
    library.mkdir(parents=True)
    from atlas.io.library import CONCEPT_SCHEMA

    concepts = [{"concept_id": i, "domain": "content", "name": f"c{i}", "description": "", "evidence_tags": [],
                 "n_tags": 1, "chunk_count": 1, "prevalence": 0.1, "taxonomy_path": None, "merged_from": [i],
                 "lifted_words": []} for i in range(n_concepts)]
    atomic_write_parquet(library / "concepts.parquet", pa.Table.from_pylist(concepts, schema=CONCEPT_SCHEMA))
    (library / "config.json").write_text(json.dumps({"n_concepts": n_concepts, "domain_offsets": {"content": 0},
                                                     "domain_sizes": {"content": n_concepts}}))
    pairs = defaultdict(list)
    for shard in range(3):
        ids = [f"doc{shard}-{i}:{i % 3:05d}" for i in range(4_000)]
        labels = [sorted(set(np.minimum(rng.zipf(1.4, rng.integers(0, 6)), n_concepts) - 1)) for _ in ids]
        for chunk, concepts_of_chunk in zip(ids, labels):
            for c in concepts_of_chunk:
                pairs[int(c)].append(chunk)
        atomic_write_parquet(run.part_path("annotated", shard), pa.table(
            {"chunk_id": ids, "domain": ["web"] * len(ids), "concepts": pa.array(labels, pa.list_(pa.int64()))}))
    config = config_from_dict({"name": "t", "run_dir": str(run.root)})
    run.write_manifest({"config": config.model_dump(), "stages": {
        "annotate": {"output": "annotated", "num_shards": 3, "hash": "h"}}})
    run.mark_stage_done("annotated", "h")
    summary = export_release(run.root, tmp_path / "out")

    for part, start in enumerate(range(0, n_concepts, 4096)):
        ids = range(start, min(start + 4096, n_concepts))
        atomic_write_parquet(tmp_path / "expected.parquet", pa.table(
            {"concept_id": list(ids), "chunk_ids": [pairs.get(c, []) for c in ids]}, schema=FIELD_GUIDE_SCHEMA))
        path = tmp_path / "out" / "field_guide" / f"part-{part:05d}.parquet"
        assert path.read_bytes() == (tmp_path / "expected.parquet").read_bytes()
    counts = Counter({c: len(chunks) for c, chunks in pairs.items()})
    assert summary["chunks"] == 12_000 and summary["concepts_used"] == len(counts)
    assert not (tmp_path / "out" / ".tmp").exists()

    # small ranges and rows: the top concepts span several ranges' worth of pairs and are cut over several rows
    import atlas.tools.export as export

    monkeypatch.setattr(export, "PAIRS_PER_PASS", 1_000)
    monkeypatch.setattr(export, "FIELD_GUIDE_IDS_PER_ROW", 700)
    export_release(run.root, tmp_path / "small")
    guide = pq.read_table(tmp_path / "small" / "field_guide").to_pydict()
    joined = defaultdict(list)
    for concept, chunks in zip(guide["concept_id"], guide["chunk_ids"]):
        joined[concept].extend(chunks)
    assert guide["concept_id"] == sorted(guide["concept_id"]) and max(map(len, guide["chunk_ids"])) == 700
    assert [joined[c] for c in range(n_concepts)] == [pairs.get(c, []) for c in range(n_concepts)]
    assert counts.most_common(1)[0][1] > 3 * 700  # the top concept's ids are cut over 4 rows or more
