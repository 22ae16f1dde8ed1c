"""A run directory in object storage, against a real S3 API (moto's server on loopback, the ``s3`` fixture): each file
goes up once, nothing is written outside the local copy whatever an object's name, neither the local copy nor the
bucket's prefix is taken from someone else, and a store that is down or refuses the credentials is one line.

Uploads are counted in the server's own request log (werkzeug's, one line per request).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

import boto3
import pytest
from conftest import BUCKET, REPO, write_config, write_jsonl
from moto.core.authorization import enable_iam_authentication

from atlas.cli import main
from atlas.config import default_local_copy
from atlas.core.lock import run_lock
from atlas.core.ownership import OWNER_FILE
from atlas.io.remote_run import RunMirror, local_run

ATLAS_MANIFEST = {"name": "earlier", "config": {}, "stages": {}, "packages": {"atlas-concepts": "0.1"}}


# --- helpers -----------------------------------------------------------------------------------------------------

@pytest.fixture
def run_url(s3, tmp_path, monkeypatch):
    """A new run URL of this test's own, with ATLAS_CACHE (the default local copies) in tmp_path/home."""
    monkeypatch.setenv("ATLAS_CACHE", str(tmp_path / "home" / "cache"))
    return f"s3://{BUCKET}/runs/{tmp_path.name}"


@pytest.fixture
def requests(caplog):
    """The S3 server's request log from here on: (method, key) in the order the server answered them."""
    caplog.set_level(logging.INFO, logger="werkzeug")

    def log() -> list[tuple[str, str]]:
        found = []
        for record in caplog.records:
            m = re.search(r'"([A-Z]+) /([^ ?]*)(\?\S*)? HTTP', record.getMessage())
            if record.name == "werkzeug" and m:
                found.append((m.group(1), unquote(m.group(2))))
        return found
    return log


def uploads(log: list[tuple[str, str]], url: str) -> Counter:
    """How many times each object under the run ``url`` was PUT, by name within the run."""
    prefix = url.removeprefix("s3://") + "/"
    return Counter(key[len(prefix):] for method, key in log if method == "PUT" and key.startswith(prefix))


def atlas(capsys, *argv: str) -> tuple[int, str]:
    """``atlas ARGV`` in this process: its exit code and what it printed on stderr."""
    capsys.readouterr()
    code = main(list(argv))
    return code, capsys.readouterr().err


def tree(folder: Path, leave_out: Path | None = None) -> dict[str, str]:
    """Every file, folder and link under ``folder`` (links not followed), but ``leave_out``: what it is or holds."""
    found = {}
    for where, folders, files in os.walk(folder):
        folders[:] = [name for name in folders if Path(where, name) != leave_out]
        for name in folders + files:
            path = Path(where, name)
            rel = path.relative_to(folder).as_posix()
            if path.is_symlink():
                found[rel] = f"link to {os.readlink(path)}"
            elif path.is_dir():
                found[rel] = "folder"
            else:
                found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def objects(s3, url: str) -> dict[str, bytes]:
    prefix = url.removeprefix("s3://")
    s3.invalidate_cache()
    return {key[len(prefix) + 1:]: s3.cat_file(key) for key in s3.find(prefix)}


def put_objects(url: str, files: dict[str, bytes]) -> None:
    """Objects put straight into the bucket under ``url``, their keys exactly as given (s3fs would tidy some)."""
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    prefix = url.removeprefix(f"s3://{BUCKET}/")
    for rel, data in files.items():
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/{rel}", Body=data)


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def docs_config(tmp_path: Path, count: int = 50) -> Path:
    """A config of ``count`` short documents, ten to a shard."""
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"id": f"d{i}", "text": f"Document {i} is about binary search "
                                                  f"in sorted arrays. " * 4} for i in range(count)])
    return write_config(tmp_path, docs)


def commands(tmp_path: Path, url: str) -> dict[str, list[str]]:
    return {"run": ["run", str(docs_config(tmp_path)), "--run-dir", url, "--inline", "--no-progress", "--stages",
                    "chunk"],
            "status": ["status", url]}


# --- (8) each file goes up once per change ---------------------------------------------------------------------------

def test_each_file_of_a_map_stage_goes_up_once(s3, run_url, tmp_path, requests, capsys):
    """5 chunk shards run one after another, each within a second or so of the one before: the files of earlier
    shards, whose times are their objects' (whole seconds), are not uploaded again by the later ones."""
    code, err = atlas(capsys, "run", str(docs_config(tmp_path)), "--run-dir", run_url, "--inline", "--no-progress",
                      "--stages", "chunk")
    assert code == 0, err
    put = uploads(requests(), run_url)
    chunks = {rel: n for rel, n in put.items() if rel.startswith("chunks/")}
    assert sorted(rel for rel in chunks if rel.startswith("chunks/part-")) == [
        f"chunks/part-{i:05d}.parquet" for i in range(5)]
    assert sorted(rel for rel in chunks if rel.startswith("chunks/_shards/")) == [
        f"chunks/_shards/{i:05d}.json" for i in range(5)]
    assert chunks == dict.fromkeys(chunks, 1)  # parts, markers, plan, stats, card, _SUCCESS: one PUT each
    assert set(objects(s3, run_url)) >= set(chunks)


def test_shards_side_by_side_in_threads_upload_each_file_once(s3, run_url, tmp_path, requests):
    """6 shards that start together and push in 6 threads at once: each sees the others' files as changed since it
    started, yet every file goes up once, and each marker after its own shard's files."""
    mirror = RunMirror(run_url, tmp_path / "copy")
    folder = mirror.root / "tokens"
    shards = 6
    since = time.time()
    for shard in range(shards):
        for rel in (f"part-{shard:05d}.parquet", f"stream/part-{shard:05d}.u32", f"_shards/{shard:05d}.json"):
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_text(f"{rel} of shard {shard}")
    start = threading.Barrier(shards)
    failures = []

    def push(shard: int) -> None:
        start.wait()
        try:
            mirror.push_shard([folder], since, folder / f"_shards/{shard:05d}.json")
        except Exception as e:  # noqa: BLE001 (reported by the assert below)
            failures.append(e)

    threads = [threading.Thread(target=push, args=(shard,)) for shard in range(shards)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not failures
    log = [key.split("/tokens/", 1)[1] for method, key in requests() if method == "PUT" and "/tokens/" in key]
    assert Counter(log) == dict.fromkeys([f"{kind}{shard:05d}{suffix}" for shard in range(shards) for kind, suffix in
                                          (("part-", ".parquet"), ("stream/part-", ".u32"), ("_shards/", ".json"))], 1)
    for shard in range(shards):
        assert log.index(f"_shards/{shard:05d}.json") > max(log.index(f"part-{shard:05d}.parquet"),
                                                             log.index(f"stream/part-{shard:05d}.u32"))


def test_a_shard_in_another_process_passes_over_files_put_up_by_this_one(s3, run_url, tmp_path, requests):
    """A pool of worker processes shares the local copy: a file settled by one process (its time set from its object)
    is not uploaded again by a shard in another, which asks the bucket."""
    mirror = RunMirror(run_url, tmp_path / "copy")
    folder = mirror.root / "chunks"
    since = time.time()
    for shard in (0, 1):
        for rel in (f"part-{shard:05d}.parquet", f"_shards/{shard:05d}.json"):
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_text(f"{rel} of shard {shard}")
    mirror.push_shard([folder], time.time(), folder / "_shards/00000.json")  # started after part 1: not its file
    code = ("import sys; from pathlib import Path; from atlas.io.remote_run import RunMirror; "
            "m = RunMirror(sys.argv[1], sys.argv[2]); f = Path(sys.argv[2]) / 'chunks'; "
            "m.push_shard([f], float(sys.argv[3]), f / '_shards/00001.json')")
    done = subprocess.run([sys.executable, "-c", code, run_url, str(mirror.root), str(since)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert uploads(requests(), run_url) == {"chunks/part-00000.parquet": 1, "chunks/_shards/00000.json": 1,
                                            "chunks/part-00001.parquet": 1, "chunks/_shards/00001.json": 1}


# --- (2) nothing is written outside the local copy -------------------------------------------------------------------

# Each case: the object's name within the run, and what it would have been written as. The local copy
# (tmp_path/home/cache/runs/s3/atlas-test/runs/NAME) is 7 folders below tmp_path; names with a part that starts with
# "_" are metadata, which `atlas status` downloads too.
HOSTILE = {
    "dot-dot": lambda tmp: "_shards/" + "../" * 8 + "escaped.json",
    "absolute": lambda tmp: f"{tmp}/_escaped-absolute.json",  # run/ + /tmp/...: a leading "/" within the run
    "backslash": lambda tmp: "_shards\\..\\..\\..\\escaped.json",
}


def seed_run(url: str, extra: dict[str, bytes] | None = None) -> None:
    put_objects(url, {"manifest.json": json.dumps(ATLAS_MANIFEST).encode(), "chunks/_shards/00000.json": b"{}",
                      **(extra or {})})


@pytest.mark.parametrize("command", ["status", "run"])
@pytest.mark.parametrize("case", [*HOSTILE, "symlink"])
def test_no_object_name_writes_outside_the_local_copy(s3, run_url, tmp_path, capsys, case, command):
    copy = default_local_copy(run_url)
    seed_run(run_url)
    if case == "symlink":  # a link in a copy made earlier leads outside it
        local_run(run_url)
        (tmp_path / "outside").mkdir()
        (copy / "_links").symlink_to(tmp_path / "outside", target_is_directory=True)
        rel = "_links/00000.json"
    else:
        rel = HOSTILE[case](tmp_path)
    put_objects(run_url, {rel: b'{"written": "outside"}'})
    argv = commands(tmp_path, run_url)[command]
    copy.parent.mkdir(parents=True, exist_ok=True)  # the folders above the copy are not what is looked at
    before = tree(tmp_path, leave_out=copy)
    code, err = atlas(capsys, *argv)
    assert tree(tmp_path, leave_out=copy) == before
    assert code == 1
    line = one_line(err)
    assert run_url in line and repr(rel) in line and "nothing was written" in line
    assert not s3.exists(f"{run_url.removeprefix('s3://')}/_lock")  # the refused run let its lock go


# --- (1) ownership: the local copy and the bucket's prefix ----------------------------------------------------------

def user_folder(folder: Path) -> dict[str, str]:
    files = {"thesis.tex": "my thesis", "data/results.csv": "a,b\n1,2\n", "manifest.json": '{"mine": 1}'}
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    return tree(folder)


@pytest.mark.parametrize("command", ["run", "status"])
def test_a_local_copy_naming_a_folder_of_the_users_is_refused(s3, run_url, tmp_path, capsys, command):
    seed_run(run_url)
    in_bucket = objects(s3, run_url)
    if command == "run":  # local_copy: names it
        folder = tmp_path / "my-files"
        argv = ["run", str(docs_config(tmp_path)), "--run-dir", run_url, "--set", f"local_copy={folder}", "--inline",
                "--no-progress", "--stages", "chunk"]
    else:  # a read command works in the default copy, which is here a folder of the user's
        folder = default_local_copy(run_url)
        argv = ["status", run_url]
    before = user_folder(folder)
    code, err = atlas(capsys, *argv)
    assert code == 1
    assert f"{folder}: not a folder Atlas created" in one_line(err)
    assert tree(folder) == before
    assert objects(s3, run_url) == in_bucket  # nothing written to the bucket either (no lock, no record)


def test_the_ownership_records_stay_on_their_side(s3, run_url, tmp_path):
    """A run Atlas starts in a bucket gets URL/.atlas-owner.json (kind run); the local copy keeps its own record, which
    pull neither deletes nor replaces, and which is never uploaded. An older run (its manifest, no record) is
    adopted; a run that wrote nothing leaves the bucket empty."""
    mirror = RunMirror(run_url, tmp_path / "copy")
    key = f"{run_url.removeprefix('s3://')}/{OWNER_FILE}"
    with pytest.raises(RuntimeError, match="refused before writing anything"):
        with run_lock(mirror.root, mirror=mirror):
            raise RuntimeError("refused before writing anything")
    assert objects(s3, run_url) == {}

    with run_lock(mirror.root, mirror=mirror):
        assert json.loads(s3.cat_file(key))["kind"] == "run"
        (mirror.root / "manifest.json").write_text(json.dumps(ATLAS_MANIFEST))
        mirror.push([mirror.root / "manifest.json"])
    local_record, bucket_record = (mirror.root / OWNER_FILE).read_bytes(), s3.cat_file(key)
    assert local_record != bucket_record
    for _ in range(2):  # pulled again, on the next run
        with run_lock(mirror.root, mirror=mirror):
            pass
        assert (mirror.root / OWNER_FILE).read_bytes() == local_record
        assert s3.cat_file(key) == bucket_record
    assert set(objects(s3, run_url)) == {"manifest.json", OWNER_FILE}

    s3.rm(key)  # a run made before the record existed
    with run_lock(mirror.root, mirror=mirror):
        pass
    assert json.loads(s3.cat_file(key))["kind"] == "run"


@pytest.mark.parametrize("command", ["run", "run --force", "status"])
def test_a_prefix_holding_objects_of_someone_else_is_refused(s3, run_url, tmp_path, capsys, command):
    """Before anything is uploaded or deleted there: --force would delete chunks/ (RunMirror.remove), and a stage's
    end the objects the local copy lacks (push_tree)."""
    put_objects(run_url, {"manifest.json": b'{"files": ["a.csv"]}', "data/a.csv": b"a,b\n1,2\n",
                          "chunks/part-00000.parquet": b"not Atlas's"})
    before = objects(s3, run_url)
    if command == "status":
        argv = ["status", run_url]
    else:
        argv = ["run", str(docs_config(tmp_path)), "--run-dir", run_url, "--inline", "--no-progress", "--stages",
                "chunk", *command.split()[1:]]
    code, err = atlas(capsys, *argv)
    assert code == 1
    assert f"{run_url}: not a run Atlas created (it holds chunks/part-00000.parquet, data/a.csv, manifest.json)" \
        in one_line(err)
    assert objects(s3, run_url) == before


# --- (6) a store that is down, or refuses the credentials: one line --------------------------------------------------

@pytest.mark.parametrize("command", ["run", "status"])
def test_a_store_that_is_down_is_one_line(s3, run_url, tmp_path, capsys, monkeypatch, command):
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now: connections are refused
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore would retry a refused connection 4 times, backing off
    code, err = atlas(capsys, *commands(tmp_path, run_url)[command])
    assert code == 1
    line = one_line(err)
    assert line.startswith(f"error: {run_url}: cannot reach the object store at http://127.0.0.1:{port} ")
    assert not (tmp_path / "home").exists()  # nor was a local copy left behind


@pytest.mark.parametrize("command", ["run", "status"])
def test_a_store_that_refuses_the_credentials_is_one_line(s3, run_url, tmp_path, capsys, command):
    seed_run(run_url)
    argv = commands(tmp_path, run_url)[command]
    with enable_iam_authentication():  # the server checks keys now: "testing" is no key it issued
        code, err = atlas(capsys, *argv)
    assert code == 1
    line = one_line(err)
    assert line.startswith(f"error: {run_url}: the object store at {os.environ['AWS_ENDPOINT_URL']} refused the "
                           f"credentials")
    assert "AWS_ACCESS_KEY_ID" in line
