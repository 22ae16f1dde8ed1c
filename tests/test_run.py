"""The stage machinery end to end on the chunk stage: outputs, skip-if-done, conflicts, --force, resume."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import write_config, write_jsonl

from atlas.cli import main
from atlas.config import load_config
from atlas.core.rundir import RunDir
from atlas.io.chunks import CHUNK_SCHEMA
from atlas.runner import run_stages


def outputs(run_dir):
    """Every data file of a run (parts and rejects), as bytes: what must be identical across runs."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*.parquet"))}


@pytest.fixture()
def small_input(tmp_path, demo_records):
    records = demo_records[:30] + [
        {"id": "empty", "text": "   \n "},
        {"id": "null", "text": None},
        {"id": demo_records[0]["id"], "text": "A second document that reuses an id. It is kept under a new id."},
    ]
    return write_jsonl(tmp_path / "docs.jsonl", records)


def test_chunk_run_writes_the_contract_and_accounts_for_every_document(tmp_path, small_input):
    config = load_config(write_config(tmp_path, small_input))
    [report] = run_stages(config, ["chunk"], log=lambda m: None)
    run = RunDir(config.run_dir)
    assert report.num_shards == 4 and sorted(report.ran) == [0, 1, 2, 3]
    table = pq.read_table(run.output_dir("chunks"))
    assert table.schema.equals(CHUNK_SCHEMA)
    rows = table.to_pylist()
    assert len({r["chunk_id"] for r in rows}) == len(rows)
    by_doc: dict[str, list] = {}
    for r in rows:
        by_doc.setdefault(r["doc_id"], []).append(r)
    for doc_rows in by_doc.values():
        assert [r["doc_end_flag"] for r in doc_rows] == [False] * (len(doc_rows) - 1) + [True]
        assert [r["chunk_id"] for r in doc_rows] == [f"{doc_rows[0]['doc_id']}:{i:05d}" for i in range(len(doc_rows))]
    dup = by_doc[f"{rows[0]['source_doc_id']}@docs.jsonl:32"][0]
    assert dup["source_doc_id"] == rows[0]["source_doc_id"]
    assert json.loads(rows[0]["metadata"])["source"] == "docs.jsonl:0"

    rejects = pq.read_table(run.output_dir("chunks") / "_rejects").to_pylist()
    assert sorted((r["doc_id"], r["reason"]) for r in rejects) == [("empty", "empty_document"), ("null", "null_text")]
    stats = json.loads(run.stats_path("chunks").read_text())["counters"]
    assert stats["docs_out"] == 31 and stats["dropped.empty_document"] == 1 and stats["dropped.null_text"] == 1
    assert stats["chunks_out"] == len(rows) and stats["tokens_out"] == sum(r["n_tokens"] for r in rows)
    manifest = run.read_manifest()
    assert manifest["stages"]["chunk"]["status"] == "done"
    assert manifest["stages"]["chunk"]["counters"] == stats
    assert manifest["packages"]["pyarrow"] and manifest["config"]["input"]["path"] == str(small_input)


def test_rerun_does_nothing_and_says_so(tmp_path, small_input, capsys):
    config_path = write_config(tmp_path, small_input)
    assert main(["run", str(config_path), "--inline", "--stages", "chunk"]) == 0
    before = outputs(tmp_path / "run")
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*.parquet")}
    capsys.readouterr()
    assert main(["run", str(config_path), "--inline", "--stages", "chunk"]) == 0
    out = capsys.readouterr().out
    assert "chunk: already done" in out and "Nothing to do" in out
    assert outputs(tmp_path / "run") == before
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*.parquet")} == stamps


def test_a_run_dir_of_another_config_is_refused_unless_forced(tmp_path, small_input, capsys):
    config_path = write_config(tmp_path, small_input)
    assert main(["run", str(config_path), "--inline", "--stages", "chunk"]) == 0
    academic_before = pq.read_table(tmp_path / "run" / "chunks", filters=[("domain", "=", "academic")]).num_rows
    capsys.readouterr()
    changed = ["run", str(config_path), "--inline", "--stages", "chunk", "--set",
               "chunk.domains.academic.max_tokens=60"]
    assert main(changed) == 2
    err = capsys.readouterr().err
    assert "already holds stage 'chunk' computed with a different configuration" in err
    assert "chunk.domains.academic.max_tokens: 150 -> 60" in err and "--force" in err
    # workers and progress do not change results, so they are not a conflict
    assert main(["run", str(config_path), "--inline", "--stages", "chunk", "--set", "execution.workers=1"]) == 0
    assert main([*changed, "--force"]) == 0
    assert (pq.read_table(tmp_path / "run" / "chunks", filters=[("domain", "=", "academic")]).num_rows
            > 2 * academic_before)


def test_changed_input_is_a_conflict(tmp_path, small_input, capsys):
    config_path = write_config(tmp_path, small_input)
    assert main(["run", str(config_path), "--inline", "--stages", "chunk"]) == 0
    with open(small_input, "a") as f:
        f.write(json.dumps({"id": "new", "text": "A new document."}) + "\n")
    assert main(["run", str(config_path), "--inline", "--stages", "chunk"]) == 2
    assert "files" in capsys.readouterr().err


def test_unfinished_shards_resume_and_give_the_same_bytes(tmp_path, small_input):
    reference = tmp_path / "ref"
    reference.mkdir()
    config = load_config(write_config(reference, small_input))
    run_stages(config, ["chunk"], log=lambda m: None)

    config = load_config(write_config(tmp_path, small_input))
    run_stages(config, ["chunk"], log=lambda m: None)
    run = RunDir(config.run_dir)
    # Simulate a crash: shard 2 lost its marker and left a half-written temporary file; the stage is unfinished.
    run.marker_path("chunks", 2).unlink()
    run.success_path("chunks").unlink()
    run.part_path("chunks", 2).write_bytes(b"half a file")
    (run.output_dir("chunks") / ".part-00001.parquet.999.tmp").write_bytes(b"junk")
    [report] = run_stages(config, ["chunk"], log=lambda m: None)
    assert report.ran == [2]
    assert outputs(tmp_path / "run") == outputs(reference / "run")


def test_broken_input_file_is_named_before_any_work(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": f"a{i}", "text": f"Doc {i}."} for i in range(5)])
    (tmp_path / "in" / "b.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00" + b"\x00" * 20)  # gzip header, then garbage
    assert main(["run", str(write_config(tmp_path, tmp_path / "in")), "--inline", "--stages", "chunk"]) == 1
    assert "b.jsonl.gz: cannot decompress" in capsys.readouterr().err


def test_a_failed_shard_keeps_the_finished_ones_and_the_rerun_does_only_it(tmp_path, capsys):
    """Corrupt the middle of a large Parquet file (its footer and fingerprint stay valid)."""
    rng = np.random.default_rng(0)
    words = np.array(["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"])
    texts = [" ".join(rng.choice(words, 300)) + f" {rng.integers(1 << 60)}." for _ in range(3000)]
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"id": [f"d{i}" for i in range(3000)], "text": texts}), path,
                   row_group_size=500, compression="none")
    original = path.read_bytes()
    assert len(original) > 3 << 20
    middle = pq.ParquetFile(path).metadata.row_group(3).column(1)
    damaged = bytearray(original)
    start = middle.data_page_offset
    damaged[start : start + 64] = b"\xff" * 64  # the page header of row group 3's text column
    path.write_bytes(bytes(damaged))
    config_path = write_config(tmp_path, path, input={"docs_per_shard": 500})
    assert main(["run", str(config_path), "--inline", "--stages", "chunk"]) == 1
    err = capsys.readouterr().err
    assert "1 of 6 shard(s) failed" in err and "shard 00003" in err and "big.parquet: row group 3" in err
    run = RunDir(tmp_path / "run")
    assert [run.is_shard_done("chunks", i, run.read_manifest()["stages"]["chunk"]["hash"]) for i in range(6)] == [
        True, True, True, False, True, True]
    capsys.readouterr()
    assert main(["status", str(tmp_path / "run")]) == 0
    status = capsys.readouterr().out
    assert "chunk            failed" in status and "5/6" in status
    assert "FAILED shard 00003:" in status and "big.parquet: row group 3" in status
    assert "tag              not started" in status
    path.write_bytes(original)  # repaired: same fingerprint, so the same stage; only shard 3 runs
    assert main(["run", str(config_path), "--inline", "--stages", "chunk"]) == 0
    assert "1 shard(s) to run, 5 already done" in capsys.readouterr().out


def test_a_stage_whose_upstream_never_ran_says_what_to_run(tmp_path, small_input, capsys):
    assert main(["run", str(write_config(tmp_path, small_input)), "--inline", "--stages", "tag"]) == 1
    assert "tag: needs stage(s) ['chunk'] first" in capsys.readouterr().err
