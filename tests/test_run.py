"""The stage machinery end to end on the chunk stage: outputs, skip-if-done, conflicts, --force, resume."""

import hashlib
import json
import os
import shutil
import time

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
    """Corrupt the middle of a large Parquet file (its footer stays valid, so only the shard reading it fails)."""
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
    assert main(["run", str(config_path), "--inline", "--stages", "chunk"]) == 1  # the same command retries shard 3
    assert "1 shard(s) to run, 5 already done" in capsys.readouterr().out
    path.write_bytes(original)  # repaired: an edit of the input like any other, so the stage is recomputed whole
    assert main(["run", str(config_path), "--inline", "--stages", "chunk"]) == 2
    assert "computed with a different configuration or input" in capsys.readouterr().err
    assert main(["run", str(config_path), "--inline", "--stages", "chunk", "--force"]) == 0
    assert "6 shard(s) to run" in capsys.readouterr().out


def test_a_stage_whose_upstream_never_ran_says_what_to_run(tmp_path, small_input, capsys):
    assert main(["run", str(write_config(tmp_path, small_input)), "--inline", "--stages", "tag"]) == 1
    assert "tag: needs stage(s) ['chunk'] first" in capsys.readouterr().err


def test_a_record_utf8_cannot_write_is_rejected_and_the_rest_of_its_shard_kept(tmp_path, capsys, demo_records):
    """A lone surrogate escape ("\\ud83d", half an emoji) failed the whole shard with UnicodeEncodeError on every
    rerun, naming no file or row."""
    records = [{"id": r["id"], "text": r["text"]} for r in demo_records[:9]]
    records.insert(4, {"id": "half-emoji", "text": "Great news \ud83d! More text follows."})
    docs = write_jsonl(tmp_path / "crawl.jsonl", records)
    assert main(["run", str(write_config(tmp_path, docs)), "--inline", "--stages", "chunk"]) == 0
    run = RunDir(tmp_path / "run")
    kept = pq.read_table(run.output_dir("chunks"), columns=["doc_id"]).column(0).to_pylist()
    assert sorted(set(kept)) == sorted(r["id"] for r in demo_records[:9])
    [reject] = pq.read_table(run.output_dir("chunks") / "_rejects").to_pylist()
    assert reject == {"file": str(docs), "row": 4, "doc_id": "half-emoji", "field": "text",
                      "reason": "invalid_unicode",
                      "detail": "lone surrogate '\\ud83d' at character 11 (not valid Unicode)"}
    assert json.loads(run.stats_path("chunks").read_text())["counters"]["dropped.invalid_unicode"] == 1


def test_every_dropped_document_is_listed_in_the_rejects(tmp_path):
    """A document whose every sentence is over chunk.max_sentence_tokens was counted as no_chunks_left, not listed."""
    records = [{"id": "short", "text": "A short sentence. Another one."},
               {"id": "long", "text": "This sentence goes on " + "and on " * 200 + "until it ends."},
               {"id": "empty", "text": "  "}, {"id": "null", "text": None}]
    config = load_config(write_config(tmp_path, write_jsonl(tmp_path / "docs.jsonl", records),
                                      chunk={"max_sentence_tokens": 100}))
    run_stages(config, ["chunk"], log=lambda m: None)
    run = RunDir(config.run_dir)
    rejects = pq.read_table(run.output_dir("chunks") / "_rejects").to_pylist()
    assert sorted((r["row"], r["doc_id"], r["reason"]) for r in rejects) == [
        (1, "long", "no_chunks_left"), (2, "empty", "empty_document"), (3, "null", "null_text")]
    assert rejects[0]["detail"] == ("every sentence or line is over chunk.max_sentence_tokens (100 tokens) and was "
                                    "dropped")
    counters = json.loads(run.stats_path("chunks").read_text())["counters"]
    assert sum(v for k, v in counters.items() if k.startswith("dropped.")) == len(rejects)


def _padded_parquet(path, texts):
    """Parquet whose text column sits between two 1.5 MB columns the chunker never reads: the text is in the middle
    of the file, more than 1 MiB from either end."""
    rng = np.random.default_rng(0)
    pad = [rng.bytes(150_000) for _ in texts]
    pq.write_table(pa.table({"pad_a": pad, "id": [f"d{i}" for i in range(len(texts))], "text": texts, "pad_b": pad}),
                   path, compression="none")
    return path


def test_a_same_length_edit_in_the_middle_of_a_large_input_is_seen(tmp_path, capsys):
    """The fingerprint hashed the first and last MiB only: a redaction in the middle left chunk "already done"."""
    texts = [f"Record {i} belongs to Alice Smith of Springfield." for i in range(10)]
    path = _padded_parquet(tmp_path / "big.parquet", texts)
    config_path = write_config(tmp_path, path)
    assert main(["run", str(config_path), "--inline", "--stages", "chunk"]) == 0
    data = path.read_bytes()
    at = data.index(b"Alice Smith")
    assert 1 << 20 < at < len(data) - (1 << 20)
    path.write_bytes(data[:at] + b"XXXXX XXXXX" + data[at + 11:])  # same length, footer untouched
    capsys.readouterr()
    assert main(["run", str(config_path), "--inline", "--stages", "chunk"]) == 2
    err = capsys.readouterr().err
    assert "computed with a different configuration or input" in err and "files.big.parquet.sha256: " in err
    assert main(["run", str(config_path), "--inline", "--stages", "chunk", "--force"]) == 0
    texts = pq.read_table(tmp_path / "run" / "chunks", columns=["chunk_text"]).column(0).to_pylist()
    assert texts[0] == "Record 0 belongs to XXXXX XXXXX of Springfield." and "Alice Smith" in texts[1]


def test_the_full_hash_is_cached_by_size_times_and_inode_and_copies_keep_the_run(tmp_path, capsys):
    texts = [f"Document {i} has a sentence." for i in range(10)]
    path = _padded_parquet(tmp_path / "big.parquet", texts)
    settled = time.time_ns() - 3_600 * 10**9
    os.utime(path, ns=(settled, settled))  # a file written a while ago (a fresh one is hashed again, see files.py)
    config_path = write_config(tmp_path, path)
    assert main(["run", str(config_path), "--inline", "--stages", "chunk"]) == 0
    cache_path = tmp_path / "run" / "_cache" / "fingerprints.json"
    cache = json.loads(cache_path.read_text())
    assert list(cache) == [str(path)] and cache[str(path)]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    # An unchanged stamp is trusted, the file is not read again: a wrong hash in the cache shows as a changed input.
    tampered = json.dumps({str(path): dict(cache[str(path)], sha256="0" * 64)})
    cache_path.write_text(tampered)
    capsys.readouterr()
    assert main(["run", str(config_path), "--inline", "--stages", "chunk"]) == 2
    assert cache_path.read_text() == tampered  # a refused run writes nothing, not even to the cache
    os.utime(path)  # any write moves mtime: the file is hashed again, and its content is what the run was made from
    assert main(["run", str(config_path), "--inline", "--stages", "chunk"]) == 0
    assert "chunk: already done" in capsys.readouterr().out
    shutil.copy(path, tmp_path / "copy.parquet")  # an identical file (new inode and times) is the same input
    os.replace(tmp_path / "copy.parquet", path)
    assert main(["run", str(config_path), "--inline", "--stages", "chunk"]) == 0
    assert "chunk: already done" in capsys.readouterr().out


def test_a_refusal_lists_only_the_values_that_changed():
    from atlas.runner import _describe_difference

    recorded = json.loads(json.dumps({"curve": ((0.0, 1.0), (3.0, 6.5)), "version": 3, "path": "runs/x"}))
    new = {"curve": ((0.0, 1.0), (3.0, 6.5)), "version": 4, "min_chunks": 5}
    assert _describe_difference(recorded, new).splitlines() == [  # a tuple read back from JSON is the same list
        "    min_chunks: null -> 5", "    path: \"runs/x\" -> null", "    version: 3 -> 4"]
