"""A run directory in object storage (``run_dir: s3://...``): worked on in a local copy, every finished shard and
stage uploaded, the run lock held in the bucket too, and a run killed on one machine finished on another.

The whole run goes to a real S3 API (moto's server on loopback, started by the ``s3`` fixture) through the real
s3fs. The mirror's rules are tested on fsspec's in-memory store, which behaves as a bucket without a server.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import fsspec
import pyarrow.parquet as pq
import pytest
from conftest import BUCKET, REPO, finish_process, wait_for, write_config, write_jsonl

from atlas.cli import main
from atlas.config import ConfigError, default_local_copy, load_config
from atlas.core.files import ArtifactError, atomic_write_json
from atlas.core.lock import RunLocked, run_lock
from atlas.io.remote_run import RunMirror, local_run
from atlas.runner import run_stages

ALL_STAGES = ["chunk", "tag", "vocab", "cluster", "coherence", "label", "library", "targets", "train_annotator",
              "annotate", "tokenize", "index"]


# --- the mirror's rules, on an in-memory store ------------------------------------------------------------------

@pytest.fixture
def memory_run(tmp_path):
    """An empty run URL in fsspec's in-memory store and a local copy folder for it."""
    url = f"memory://bucket/{tmp_path.name}/run"
    yield url, RunMirror(url, tmp_path / "copy")
    memory = fsspec.filesystem("memory")
    if memory.exists(f"/bucket/{tmp_path.name}"):
        memory.rm(f"/bucket/{tmp_path.name}", recursive=True)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_pull_makes_the_copy_equal_to_the_bucket_and_keeps_what_is_machine_local(memory_run):
    url, mirror = memory_run
    fs, root = mirror.fs, mirror.root
    for rel, text in {"manifest.json": "{}", "chunks/part-00000.parquet": "p0", "chunks/_shards/00000.json": "m0",
                      "report/index.html": "bucket's report"}.items():
        fs.pipe_file(f"{mirror.base}/{rel}", text.encode())
    write(root / "chunks/part-00000.parquet", "an older p0, same size? no: longer")
    write(root / "chunks/part-00001.parquet", "a part the bucket never got")  # a shard killed before its upload
    write(root / "_cache/tag/00000.jsonl", "answers")
    write(root / "cblm/toy/model.pt", "a model trained in the copy")
    write(root / "report/extra.png", "a plot")

    mirror.pull()
    assert (root / "chunks/part-00000.parquet").read_text() == "p0"
    assert (root / "chunks/_shards/00000.json").read_text() == "m0"
    assert (root / "report/index.html").read_text() == "bucket's report"
    assert not (root / "chunks/part-00001.parquet").exists()  # redone: no marker in the bucket vouched for it
    for kept in ("_cache/tag/00000.jsonl", "cblm/toy/model.pt", "report/extra.png"):
        assert (root / kept).exists(), kept
    # In step now: a second pull downloads nothing, even after the bucket's listing is read again.
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}
    mirror.pull()
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()} == before


def test_a_shard_uploads_its_files_then_its_own_marker_only(memory_run):
    url, mirror = memory_run
    root, uploaded = mirror.root, []
    real_put = mirror.fs.put_file
    mirror.fs.put_file = lambda local, key, **kw: (uploaded.append(key.split("/run/", 1)[1]),
                                                   real_put(local, key, **kw))
    write(root / "tokens/_shards/00000.json", "{}")  # shard 0 finished earlier
    since = os.path.getmtime(root / "tokens/_shards/00000.json") + 5
    for rel in ("tokens/part-00001.parquet", "tokens/stream/part-00001.u32", "tokens/_shards/00002.json"):
        write(root / rel, rel)
        os.utime(root / rel, (since, since))  # written while shard 1 ran (shard 2's marker too, by another worker)
    marker = write(root / "tokens/_shards/00001.json", "{}")
    mirror.push_shard([root / "tokens"], since, marker)
    assert uploaded == ["tokens/part-00001.parquet", "tokens/stream/part-00001.u32", "tokens/_shards/00001.json"]
    # push_tree puts up the rest, markers after data and _SUCCESS last; what is in step is not uploaded again
    write(root / "tokens/_SUCCESS", "{}")
    write(root / "tokens/_stats.json", "{}")
    mirror.fs.pipe_file(f"{mirror.base}/tokens/_staging/00001.npz", b"merged by the stage, gone locally")
    for neighbour in (f"{mirror.base}/tokens_v2/part-00000.parquet", f"{mirror.base}2/manifest.json"):
        mirror.fs.pipe_file(neighbour, b"another folder that a bare prefix would match")
    uploaded.clear()
    mirror.push_tree([root / "tokens"])
    assert uploaded == ["tokens/_stats.json", "tokens/_shards/00000.json", "tokens/_shards/00002.json",
                        "tokens/_SUCCESS"]
    assert sorted(mirror.fs.find(f"{mirror.base}/tokens")) == sorted(
        f"{mirror.base}/{p.relative_to(root).as_posix()}" for p in root.rglob("*") if p.is_file())
    assert mirror.fs.exists(f"{mirror.base}/tokens_v2/part-00000.parquet")  # never taken for a file of tokens/


def test_the_lock_is_held_in_the_bucket_and_a_dead_holder_of_this_host_is_taken_over(memory_run, caplog):
    url, mirror = memory_run
    key = f"{mirror.base}/_lock"
    other = {"pid": 4242, "host": "gpu-node-7", "started": "2026-11-24T10:00:00+0000", "command": "atlas run x"}
    mirror.fs.pipe_file(key, json.dumps(other).encode())
    with pytest.raises(RunLocked, match=rf"^{url} is in use by another atlas run \(pid 4242 on host gpu-node-7, "
                                        rf"started .*: atlas run x\); .* remove {url}/_lock$"):
        with run_lock(mirror.root, mirror=mirror):
            pass
    assert not (mirror.root / "_lock").exists()  # the local lock was given back

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mirror.fs.pipe_file(key, json.dumps(dict(other, pid=dead.pid, host=socket.gethostname())).encode())
    with run_lock(mirror.root, "atlas run demo", mirror=mirror):
        assert json.loads(mirror.fs.cat_file(key))["pid"] == os.getpid()
    assert "which is no longer running; taking it over" in caplog.text
    assert not mirror.fs.exists(key)


def test_a_copy_holding_a_run_the_bucket_lacks_is_not_overwritten(memory_run):
    url, mirror = memory_run
    atomic_write_json(mirror.root / "manifest.json", {"name": "an earlier run"})
    with pytest.raises(ArtifactError, match=rf"^{url} holds no run, but its local copy {mirror.root} holds one"):
        mirror.pull()
    assert (mirror.root / "manifest.json").exists()


def test_a_run_dir_url_is_worked_on_in_a_local_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("ATLAS_CACHE", str(tmp_path / "cache"))
    config = load_config(write_config(tmp_path, tmp_path / "docs.jsonl"), run_dir="s3://bucket/runs/x/")
    assert config.run_url == "s3://bucket/runs/x"
    assert config.run_dir == str(tmp_path / "cache/runs/s3/bucket/runs/x") == str(default_local_copy("s3://bucket/runs/x"))
    chosen = load_config(write_config(tmp_path, tmp_path / "docs.jsonl"), ["local_copy=copy"], run_dir="gs://b/r")
    assert chosen.run_dir == str(tmp_path / "copy")  # relative to the config file, as run_dir
    with pytest.raises(ConfigError, match="local_copy .*: only used with a run_dir in object storage"):
        load_config(write_config(tmp_path, tmp_path / "docs.jsonl"), ["local_copy=copy"])
    with pytest.raises(ConfigError, match=r"'\.\.' is not allowed"):
        load_config(write_config(tmp_path, tmp_path / "docs.jsonl"), run_dir="s3://bucket/../../etc")
    with pytest.raises(ConfigError, match="run_url is set by Atlas"):
        load_config(write_config(tmp_path, tmp_path / "docs.jsonl", run_url="s3://b/r"))


def test_slurm_tasks_refuse_a_run_in_object_storage(capsys):
    assert main(["stage", "chunk", "--run-dir", "s3://bucket/runs/x", "--shard", "0"]) == 2
    assert "SLURM array tasks need the run directory on a file system their nodes share" in capsys.readouterr().err


# --- a whole run in a bucket on loopback, killed and finished on another machine ---------------------------------

def table(path: Path):
    return pq.read_table(path)


@pytest.mark.timeout(900)
def test_a_run_in_a_bucket_is_killed_then_finished_from_another_machine(s3, trained, demo_records, tmp_path,
                                                                          monkeypatch):
    """The ``trained`` fixture's documents (cut short) and settings, run whole in s3://atlas-test/runs/..., killed by
    SIGKILL once the tag stage's first marker is in the bucket, then finished with another local copy (another
    machine)."""
    sources = ("python-docs", "python-math-docs", "python-stdlib")
    picked = [r for source in sources for r in [d for d in demo_records if d["data_src"] == source][:10]]
    # Each text cut to its first 4,000 characters: whole, the stdlib's modules (up to 20,000) made most of the 273
    # chunks, and every run here encodes every chunk several times. Cut, 104 chunks still make 3 shards of 10
    # documents (so shards 1 and 2 are left for machine b) and a library of concepts.
    docs = write_jsonl(tmp_path / "docs.jsonl", [dict(r, label=r["data_src"], text=r["text"][:4000]) for r in picked])
    # A folder of this test's own: moto keeps its buckets per process, and test_remote_inputs leaves its documents
    # in corpus/, which a run of s3://atlas-test/corpus/ would read too (7 shards, not 3, in a whole test run).
    corpus = f"{BUCKET}/inputs/{tmp_path.name}"
    s3.put_file(str(docs), f"{corpus}/docs.jsonl")
    url = f"s3://{BUCKET}/runs/{tmp_path.name}"
    sections = {key: getattr(trained[0], key).model_dump() for key in ("library", "tag", "annotator")}
    config_path = write_config(tmp_path, f"s3://{corpus}/", input={"metadata_fields": ["label"]},
                               index={"code_bytes": 8}, **sections)
    monkeypatch.setenv("ATLAS_CACHE", str(tmp_path / "machine-a"))

    killed = subprocess.Popen([sys.executable, "-m", "atlas.cli", "run", str(config_path), "--run-dir", url,
                               "--inline", "--no-progress"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    bucket = f"{BUCKET}/runs/{tmp_path.name}"
    try:
        wait_for(lambda: s3.exists(f"{bucket}/tags/_shards/00000.json") or killed.poll() is not None,
                 "the tag stage's first marker in the bucket", timeout=600, interval=0.05)
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        finish_process(killed, "the killed run", timeout=60)
    assert s3.exists(f"{bucket}/chunks/_SUCCESS") and not s3.exists(f"{bucket}/tags/_SUCCESS")
    assert json.loads(s3.cat_file(f"{bucket}/_lock"))["host"] == socket.gethostname()  # left by the killed driver

    monkeypatch.setenv("ATLAS_CACHE", str(tmp_path / "machine-b"))
    config = load_config(config_path, run_dir=url)
    reports = run_stages(config, log=lambda m: None)
    ran = {r.name: r.ran for r in reports}
    assert [r.name for r in reports if r.skipped] == ["chunk"]
    assert 0 not in ran["tag"] and ran["tag"]  # shard 0 came from the bucket, the rest was done here

    # The bucket holds the run the local copy holds, file for file, every stage finished and no lock.
    copy = Path(config.run_dir)
    assert copy == tmp_path / "machine-b/runs/s3" / bucket
    local = {p.relative_to(copy).as_posix(): p for p in copy.rglob("*")
             if p.is_file() and p.relative_to(copy).parts[0] not in ("_cache", "_tmp")}
    remote = {k[len(bucket) + 1:] for k in s3.find(bucket)}
    assert remote == set(local)
    for rel in ("manifest.json", "tags/part-00001.parquet", "library/concepts.parquet", "tokens/_SUCCESS"):
        assert s3.cat_file(f"{bucket}/{rel}") == local[rel].read_bytes(), rel
    manifest = json.loads(s3.cat_file(f"{bucket}/manifest.json"))
    assert {name: info["status"] for name, info in manifest["stages"].items()} == dict.fromkeys(ALL_STAGES, "done")

    # Killed and resumed elsewhere, the outputs are those of an uninterrupted local run (of the stages up to the one
    # that was killed: the others ran once, in the resumed run).
    local_config = load_config(config_path, run_dir=tmp_path / "uninterrupted")
    run_stages(local_config, ["chunk", "tag"], log=lambda m: None)
    for output in ("chunks", "tags"):
        parts = sorted((tmp_path / "uninterrupted" / output).glob("part-*.parquet"))
        assert [p.name for p in parts] == sorted(p.name for p in (copy / output).glob("part-*.parquet"))
        for part in parts:
            assert table(copy / output / part.name).equals(table(part)), part

    # Commands that read a run take its URL: they read a local copy pulled first (here machine a's, brought level).
    monkeypatch.setenv("ATLAS_CACHE", str(tmp_path / "machine-a"))
    assert main(["status", url]) == 0
    assert local_run(url) == tmp_path / "machine-a/runs/s3" / bucket
    assert (tmp_path / "machine-a/runs/s3" / bucket / "index/_SUCCESS").exists()
    assert main(["run", str(config_path), "--run-dir", url, "--inline", "--no-progress"]) == 0  # nothing left
