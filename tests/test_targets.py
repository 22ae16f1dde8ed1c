"""The targets stage's out-of-core pieces: rows put back in place order from disk, and its list columns built
from Arrow arrays."""

import json
import shutil
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

from atlas.core.files import ArtifactError
from atlas.stages.targets import ByPlace, list_array, sorted_union


def placed_batches(n: int, batch_rows: int, seed: int = 0) -> list[pa.RecordBatch]:
    place = np.random.default_rng(seed).permutation(n)
    table = pa.table({"place": place, "text": [f"text {p} " * (p % 7) for p in place.tolist()]})
    return table.to_batches(max_chunksize=batch_rows)


@pytest.mark.parametrize("n, rows, max_files", [(0, 4, 256), (1, 4, 256), (103, 10, 256), (103, 10, 3), (40, 10, 4)])
def test_by_place_gives_the_rows_back_in_place_order(tmp_path, monkeypatch, n, rows, max_files):
    monkeypatch.setattr(ByPlace, "MAX_FILES", max_files)
    batches = placed_batches(n, 9)
    schema = batches[0].schema if batches else pa.schema([("place", pa.int64()), ("text", pa.string())])
    with ByPlace(tmp_path / "spill", n, rows, schema, "bad places") as placed:
        for batch in batches:
            placed.write(batch)
    assert placed.written == n and len(placed.paths) <= max_files
    out = pa.Table.from_batches(list(placed.read(["text", "place"])), schema=pa.schema([schema.field("text"),
                                                                                          schema.field("place")]))
    assert out.column("place").to_pylist() == list(range(n))
    assert out.column("text").to_pylist() == [f"text {p} " * (p % 7) for p in range(n)]
    assert all(b.num_rows <= placed.rows for b in placed.read(["text"]))  # one file's rows at a time


def test_by_place_says_when_a_place_is_missing_or_repeated(tmp_path):
    batch = pa.record_batch({"place": [0, 1, 1, 3], "text": ["a", "b", "b", "d"]})  # 2 missing, 1 twice
    with ByPlace(tmp_path / "spill", 4, 2, batch.schema, "chunks missing or repeated") as placed:
        placed.write(batch)
    assert placed.written == 4
    with pytest.raises(ArtifactError, match="chunks missing or repeated"):
        list(placed.read(["text"]))


def test_list_columns_are_the_python_lists():
    rng = np.random.default_rng(1)
    content = [sorted(rng.choice(50, rng.integers(0, 4), replace=False).tolist()) for _ in range(200)]
    tone = [rng.choice(10, rng.integers(0, 3), replace=False).tolist() for _ in range(200)]  # in chosen order
    lists = {"content": pa.array(content, pa.list_(pa.int64())).slice(0), "tone": list_array(tone, 100)}
    assert lists["tone"].to_pylist() == [[100 + j for j in row] for row in tone]
    assert lists["tone"].type == pa.list_(pa.int64())
    union = sorted_union(lists.values())
    assert union.to_pylist() == [sorted(c + [100 + j for j in t]) for c, t in zip(content, tone)]
    sliced = pa.array(content, pa.list_(pa.int64())).slice(50, 20)  # offsets not starting at 0
    assert sorted_union([sliced, list_array(tone[50:70], 100)]).to_pylist() == [
        sorted(c + [100 + j for j in t]) for c, t in zip(content[50:70], tone[50:70])]
    assert sorted_union([list_array([], 0)]).to_pylist() == []


@pytest.mark.slow  # the trained run loads the embedding model
def test_targets_rerun_in_small_pieces_writes_the_same_bytes(trained, tmp_path, monkeypatch):
    """The reservoir read from the join a few rows at a time and spread over many files gives the targets the stage
    wrote in one piece (the embeddings come from the run's cache)."""
    import atlas.stages.targets as targets
    from atlas.config import config_from_dict
    from atlas.core.rundir import RunDir

    config, run = trained
    root = tmp_path / "run"
    shutil.copytree(run.root, root)
    manifest = json.loads((root / "manifest.json").read_text())
    copy = RunDir(root)
    before = copy.part_path("targets", 0).read_bytes()
    monkeypatch.setattr(targets, "SPILL_ROWS", 7)
    monkeypatch.setattr(targets, "SPILL_FILE_ROWS", 40)
    stage = targets.TargetsStage(config_from_dict(manifest["config"] | {"run_dir": str(root)}))
    stage.setup()
    stats = stage.run_shard(copy, 0).to_dict()
    assert copy.part_path("targets", 0).read_bytes() == before
    assert stats["reservoir"] > 3 * 40  # several spill files
    assert stats["chunks_embedded"] == 0 and stats["reservoir"] == stats["train"] + stats["heldout"]
    assert not (root / "_tmp").exists()


@pytest.mark.slow  # the trained run loads the embedding model
def test_only_the_librarys_fields_inherit_concepts(run_copy):
    """A style tag whose words are a mapped topic tag ("tone: recursion" beside "algorithm: recursion") gives its chunk
    no content concept: neither in the targets the annotator learns from nor in ``chunk_concepts``."""
    import pyarrow.parquet as pq

    import atlas.stages.targets as targets
    from atlas.config import config_from_dict
    from atlas.core.rundir import RunDir
    from atlas.io.library import chunk_concept_votes, chunk_concepts, load_library

    run = RunDir(run_copy)
    fields = load_library(run)[1]["fields"]
    used = {f for part in run.parts("tags") for f in pq.read_table(part, columns=["field"])["field"].to_pylist()}
    assert fields and set(fields) < used  # the topic fields, not the style ones
    mapping = pq.read_table(run.output_dir("library") / "tag_to_concept.parquet").to_pylist()
    mapped = next(m for m in mapping if m["concept_id"] is not None)
    before = chunk_concepts(run)
    # the votes behind that order: one per tag of a library field that maps to the concept (the library eval's counts)
    concept_of = {m["tag_norm"]: m["concept_id"] for m in mapping if m["concept_id"] is not None}
    expected = Counter((row["chunk_id"], concept_of[row["tag_norm"]]) for part in run.parts("tags")
                       for row in pq.read_table(part).to_pylist()
                       if row["field"] in fields and row["tag_norm"] in concept_of)
    votes = chunk_concept_votes(run)
    assert {(chunk, c): n for chunk, v in votes.items() for c, n in v.items()} == dict(expected)
    # and a partial vote for each near concept, in the library's reading only (not a target below): read in each
    # chunk (library/near_votes.parquet, clustered with contexts) ...
    in_context = run.output_dir("library") / "near_votes.parquet"
    near = Counter({(r["chunk_id"], r["concept_id"]): r["votes"] for r in pq.read_table(in_context).to_pylist()})
    assert near and {(chunk, c): n for chunk, v in chunk_concept_votes(run, 0.25).items() for c, n in v.items()} == {
        key: expected.get(key, 0) + 0.25 * near.get(key, 0) for key in expected | near}
    # ... or, where there are none (clustered without contexts), each tag's near concept
    in_context.rename(in_context.with_name("elsewhere.parquet"))
    near_of = {m["tag_norm"]: m["near_concept_id"] for m in mapping if m["near_concept_id"] is not None}
    near = Counter((row["chunk_id"], near_of[row["tag_norm"]]) for part in run.parts("tags")
                   for row in pq.read_table(part).to_pylist()
                   if row["field"] in fields and row["tag_norm"] in near_of)
    assert near and {(chunk, c): n for chunk, v in chunk_concept_votes(run, 0.25).items() for c, n in v.items()} == {
        key: expected.get(key, 0) + 0.25 * near.get(key, 0) for key in expected | near}
    in_context.with_name("elsewhere.parquet").rename(in_context)
    assert {chunk: list(v) for chunk, v in votes.items()} == before and max(expected.values()) > 1
    tag_part = run.parts("tags")[0]
    tags = pq.read_table(tag_part)
    untouched = next(c for c in tags.column("chunk_id").to_pylist() if mapped["concept_id"] not in before.get(c, []))
    style = next(f for f in sorted(used) if f not in fields)
    extra = pa.table({"chunk_id": [untouched], "field": [style], "tag": [mapped["tag_norm"]],
                      "tag_norm": [mapped["tag_norm"]], "rank": pa.array([0], pa.int16())}, schema=tags.schema)
    pq.write_table(pa.concat_tables([tags, extra]), tag_part)
    assert chunk_concepts(run) == before

    manifest = json.loads((run_copy / "manifest.json").read_text())
    stage = targets.TargetsStage(config_from_dict(manifest["config"]))
    stage.setup()
    stage.run_shard(run, 0)
    rows = pq.read_table(run.part_path("targets", 0), columns=["chunk_id", "content_global_ids"]).to_pylist()
    assert rows and all(sorted(r["content_global_ids"]) == sorted(before.get(r["chunk_id"], [])) for r in rows)
