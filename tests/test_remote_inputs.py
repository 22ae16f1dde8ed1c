"""Inputs in object storage: ``input.path: s3://bucket/prefix/`` reads, shards and chunks exactly as the same files
in a local folder. A real S3 API (moto's server on loopback) and the real s3fs; the server starts once for the module.

hf:// (Hugging Face Hub) cannot be reached offline. It takes the same generic fsspec code path as every other URL
(``atlas.io.inputs.filesystem``: nothing in Atlas names a scheme but s3's extra and endpoint), which the memory://
test below runs through without S3 at all.
"""

import dataclasses
import filecmp
import gzip
import hashlib
import importlib.util
import io
import json

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import BUCKET, write_config, write_jsonl

from atlas.cli import main
from atlas.config import InputConfig
from atlas.core.extras import MissingExtra
from atlas.core.rundir import RunDir
from atlas.io.inputs import Document, InputError, Reject, plan_shards, read_shard, url_fingerprint


@pytest.fixture(scope="module")
def corpus(s3, demo_records, tmp_path_factory):
    """A local folder of JSONL files (a plain one with bad lines, a .gz one with an id the plain one has too) and its
    copy at s3://atlas-test/corpus/; a Parquet file of small row groups, locally and in the bucket."""
    picked = [r for source in sorted({d["data_src"] for d in demo_records})
              for r in [d for d in demo_records if d["data_src"] == source][:10]]
    local = tmp_path_factory.mktemp("local")
    folder = local / "corpus"
    (folder / "sub").mkdir(parents=True)
    bad = ['{"id": "broken", "text": unquoted}', json.dumps({"id": "no-text", "body": "x"})]
    write_jsonl(folder / "a.jsonl", picked[:12] + bad + picked[12:20])
    lines = "".join(json.dumps(r) + "\n" for r in [dict(picked[20], id=picked[3]["id"]), *picked[21:30]])
    (folder / "sub" / "b.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    pq.write_table(pa.Table.from_pylist([{k: r[k] for k in ("id", "text", "domain", "data_src")}
                                         for r in picked[10:40]]), local / "c.parquet", row_group_size=4)
    for path in [*folder.rglob("*.jsonl*"), local / "c.parquet"]:
        s3.pipe(f"{BUCKET}/{path.relative_to(local).as_posix()}", path.read_bytes())
    return local


def read_all(cfg: InputConfig, folder) -> tuple[dict, list[Document], list[Reject]]:
    folder.mkdir(exist_ok=True)
    plan = plan_shards(cfg, folder)
    items = [item for shard in range(len(plan["shards"])) for item in read_shard(plan, shard, cfg, folder)]
    return plan, [i for i in items if isinstance(i, Document)], [i for i in items if isinstance(i, Reject)]


def as_remote(items: list, local_root, url_root: str) -> list[dict]:
    """Documents or rejects as dicts, their file named as it is in the bucket."""
    return [dataclasses.asdict(i) | {"file": i.file.replace(str(local_root), url_root)} for i in items]


def test_a_bucket_folder_reads_as_the_same_local_folder(corpus, tmp_path):
    settings = {"id_field": "id", "metadata_fields": ["meta"], "docs_per_shard": 4}
    local_plan, local_docs, local_rejects = read_all(InputConfig(path=str(corpus / "corpus"), **settings),
                                                     tmp_path / "local")
    plan, docs, rejects = read_all(InputConfig(path=f"s3://{BUCKET}/corpus/", **settings), tmp_path / "remote")
    assert plan["files"] == [f"s3://{BUCKET}/corpus/a.jsonl", f"s3://{BUCKET}/corpus/sub/b.jsonl.gz"]
    assert len(docs) == 30 and plan["renamed"] == local_plan["renamed"] == 1
    assert [dataclasses.asdict(d) for d in docs] == as_remote(local_docs, corpus, f"s3://{BUCKET}")
    assert docs[20].doc_id == f"{docs[3].doc_id}@sub/b.jsonl.gz:0"  # an id a.jsonl has, renamed the same way
    assert [dataclasses.asdict(r) for r in rejects] == as_remote(local_rejects, corpus, f"s3://{BUCKET}")
    assert [(r.file, r.row, r.reason) for r in rejects] == [(f"s3://{BUCKET}/corpus/a.jsonl", 12, "invalid_json"),
                                                             (f"s3://{BUCKET}/corpus/a.jsonl", 13, "missing_field")]
    # the same shards, with the same byte offsets into the plain file; the .gz one is read from its start
    assert [{**s, "file": s["file"].replace(str(corpus), f"s3://{BUCKET}")} for s in local_plan["shards"]] \
        == plan["shards"]
    assert [s["offset"] is not None for s in plan["shards"]] == [True] * 6 + [False] * 3


def test_a_jsonl_shard_that_starts_at_a_byte_offset_reads_alone(corpus, tmp_path):
    url = f"s3://{BUCKET}/corpus/a.jsonl"
    cfg = InputConfig(path=url, id_field="id", docs_per_shard=3)
    plan = plan_shards(cfg, tmp_path)
    lines = (corpus / "corpus" / "a.jsonl").read_bytes().splitlines(keepends=True)
    last = plan["shards"][-1]
    assert last["offset"] == sum(len(line) for line in lines[:last["start"]]) > 0
    docs = list(read_shard(plan, len(plan["shards"]) - 1, cfg, tmp_path))  # alone: the reader seeks to its offset
    expected = [json.loads(line) for line in lines[last["start"]:]]
    assert [(d.row, d.doc_id, d.text) for d in docs] == [(last["start"] + i, r["id"], r["text"])
                                                         for i, r in enumerate(expected)]


def test_parquet_in_a_bucket_by_row_ranges_and_by_glob(corpus, tmp_path):
    _, local_docs, _ = read_all(InputConfig(path=str(corpus / "c.parquet"), id_field="id", docs_per_shard=7),
                                tmp_path / "local")
    for path in (f"s3://{BUCKET}/c.parquet", f"s3://{BUCKET}/*.parquet"):
        plan, docs, rejects = read_all(InputConfig(path=path, id_field="id", docs_per_shard=7), tmp_path / "remote")
        assert [(s["start"], s["stop"]) for s in plan["shards"]] == [(0, 6), (6, 12), (12, 18), (18, 24), (24, 30)]
        assert [dataclasses.asdict(d) for d in docs] == as_remote(local_docs, corpus, f"s3://{BUCKET}")
        assert len(docs) == 30 and not rejects


def test_a_chunk_run_from_a_bucket_writes_the_same_parts_and_sees_a_changed_file(corpus, s3, tmp_path, capsys):
    settings = {"input": {"metadata_fields": ["meta"], "docs_per_shard": 8}}
    (tmp_path / "local").mkdir()
    (tmp_path / "bucket").mkdir()
    local = write_config(tmp_path / "local", corpus / "corpus", **settings)
    assert main(["run", str(local), "--inline", "--stages", "chunk"]) == 0
    command = ["run", str(write_config(tmp_path / "bucket", f"s3://{BUCKET}/corpus/", **settings)), "--inline",
               "--stages", "chunk"]
    assert main(command) == 0
    local_run, remote_run = RunDir(tmp_path / "local" / "run"), RunDir(tmp_path / "bucket" / "run")
    parts = local_run.parts("chunks")
    assert [p.name for p in remote_run.parts("chunks")] == [p.name for p in parts] and len(parts) == 5
    assert all(filecmp.cmp(p, remote_run.part_path("chunks", i), shallow=False) for i, p in enumerate(parts))
    rejects = pq.read_table(remote_run.output_dir("chunks") / "_rejects").to_pylist()
    assert {(r["file"], r["row"], r["reason"]) for r in rejects} == {
        (f"s3://{BUCKET}/corpus/a.jsonl", 12, "invalid_json"), (f"s3://{BUCKET}/corpus/a.jsonl", 13, "missing_field")}
    identity = remote_run.read_manifest()["stages"]["chunk"]["identity"]["files"]
    assert identity["a.jsonl"]["ETag"] == s3.info(f"{BUCKET}/corpus/a.jsonl")["ETag"]

    capsys.readouterr()
    plain = (corpus / "corpus" / "a.jsonl").read_bytes()
    s3.pipe(f"{BUCKET}/corpus/a.jsonl", plain)  # uploaded again, unchanged: the same ETag, nothing to redo
    assert main(command) == 0
    assert "chunk: already done" in capsys.readouterr().out
    first, *rest = plain.splitlines(keepends=True)
    record = json.loads(first)
    edited = b"".join([(json.dumps(dict(record, text="EDITED " + record["text"])) + "\n").encode(), *rest])
    s3.pipe(f"{BUCKET}/corpus/a.jsonl", edited)
    try:
        assert main(command) == 2  # refused, as for a changed local file
        err = capsys.readouterr().err
        assert "computed with a different configuration or input" in err and "files.a.jsonl.ETag: " in err
        assert main([*command, "--force"]) == 0
        texts = pq.read_table(remote_run.part_path("chunks", 0), columns=["chunk_text"]).column(0).to_pylist()
        assert texts[0].startswith("EDITED ")
    finally:
        s3.pipe(f"{BUCKET}/corpus/a.jsonl", plain)  # the module's other tests read the original


def test_unknown_scheme_missing_bucket_and_missing_package_are_named(s3, tmp_path, capsys):
    with pytest.raises(InputError) as err:
        plan_shards(InputConfig(path="foo://x/docs.jsonl"))
    message = str(err.value)
    assert message.startswith("foo://x/docs.jsonl: unknown URL scheme 'foo://'; input.path is a local path, or a URL "
                              "of a scheme fsspec knows: ")
    assert all(f" {scheme}," in message for scheme in ("gs", "hf", "s3"))
    with pytest.raises(InputError, match=r"^input not found: s3://no-such-bucket/corpus/ "
                                         r"\(The specified bucket does not exist\)$"):
        plan_shards(InputConfig(path="s3://no-such-bucket/corpus/"))
    with pytest.raises(InputError, match=rf"^input not found: s3://{BUCKET}/absent.jsonl$"):
        plan_shards(InputConfig(path=f"s3://{BUCKET}/absent.jsonl"))
    config = write_config(tmp_path, "s3://no-such-bucket/corpus/")
    assert main(["run", str(config), "--inline", "--stages", "chunk"]) == 1
    assert "error: input not found: s3://no-such-bucket/corpus/ (The specified bucket does not exist)" \
        in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    if importlib.util.find_spec("gcsfs") is None:  # a scheme fsspec knows, whose package is not installed
        with pytest.raises(MissingExtra, match=r"^input.path gs://b/docs.jsonl: reading gs:// needs a package that is "
                                               r"not installed: Please install gcsfs"):
            plan_shards(InputConfig(path="gs://b/docs.jsonl"))


def test_any_fsspec_url_reads_through_the_same_code(corpus, tmp_path):
    """memory:// (fsspec's own, no package, no server) takes the path that hf://, gs:// and the others take."""
    memory = fsspec.filesystem("memory")
    for path in (corpus / "corpus").rglob("*.jsonl*"):
        memory.pipe(f"/atlas-test/{path.relative_to(corpus).as_posix()}", path.read_bytes())
    try:
        _, local_docs, _ = read_all(InputConfig(path=str(corpus / "corpus"), id_field="id"), tmp_path / "local")
        plan, docs, _ = read_all(InputConfig(path="memory://atlas-test/corpus", id_field="id"), tmp_path / "remote")
        assert plan["files"] == ["memory:///atlas-test/corpus/a.jsonl", "memory:///atlas-test/corpus/sub/b.jsonl.gz"]
        assert [dataclasses.asdict(d) for d in docs] == as_remote(local_docs, corpus, "memory:///atlas-test")
        # the memory store tags no version: the file's bytes are hashed, as a local file's are
        gz = (corpus / "corpus" / "sub" / "b.jsonl.gz").read_bytes()
        assert url_fingerprint("memory://atlas-test/corpus/sub/b.jsonl.gz") == {
            "size": len(gz), "sha256": hashlib.sha256(gz).hexdigest()}
    finally:
        memory.rm("/atlas-test", recursive=True)


def test_a_run_dir_url_never_becomes_a_local_folder_and_an_unknown_scheme_is_named(tmp_path, monkeypatch, capsys):
    """`Path("s3://b/run")` would be a local folder "s3:/b/run"; a URL run works in the local copy under
    $ATLAS_CACHE instead (tests/test_remote_run.py), and a scheme fsspec does not know is an error before any work."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ATLAS_CACHE", str(tmp_path / "cache"))
    config = write_config(tmp_path, write_jsonl(tmp_path / "docs.jsonl", [{"id": "a", "text": "A sentence."}]))
    assert main(["run", str(config), "--inline", "--stages", "chunk", "--run-dir", "foo://bucket/runs/demo"]) == 1
    assert ("error: foo://bucket/runs/demo: unknown URL scheme 'foo://'; run_dir is a local path, or a URL of a "
            "scheme fsspec knows: ") in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "docs.jsonl"]  # no "foo:", no local copy


def test_remote_reading_keeps_a_gz_stream_from_its_start(corpus, tmp_path):
    """A .jsonl.gz shard in a bucket is decompressed from the file's start, as locally: its rows are the file's."""
    url = f"s3://{BUCKET}/corpus/sub/b.jsonl.gz"
    cfg = InputConfig(path=url, id_field="id", docs_per_shard=4)
    plan = plan_shards(cfg, tmp_path)
    assert [(s["start"], s["offset"]) for s in plan["shards"]] == [(0, None), (4, None), (8, None)]
    lines = io.BytesIO(gzip.decompress((corpus / "corpus" / "sub" / "b.jsonl.gz").read_bytes())).readlines()
    docs = list(read_shard(plan, 2, cfg, tmp_path))
    assert [(d.row, d.text) for d in docs] == [(8 + i, json.loads(line)["text"]) for i, line in enumerate(lines[8:])]
