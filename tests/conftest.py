"""Shared fixtures. Tests run offline; ../shared/data is used when present and skipped otherwise."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")  # busy CI machines start slowly
# Ray 2.60 turns token authentication on by default, and a process keeps the mode of its first ray.init: a driver
# with it on rejects the calls of a cluster started with it off (tests/test_ray.py), and its actors die at once.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data" / "dev"


# --- the end: pytest's exit status, without the interpreter's teardown -------------------------------------------

_exit_status: list[int] = []


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave with the suite's status once pytest is done. This one process has loaded torch, faiss, DuckDB, Ray and
    Prefect, whose native threads outlive the tests: once (2026-11-28, 2 busy cores, every test passed) the
    interpreter's teardown crashed (SIGSEGV, exit status 139; a jump into freed memory), which fails CI for nothing a
    test saw."""
    if _exit_status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[-1])


# --- deadlines: a slow machine gets a failure that says what it waited for, not pytest's timeout ---------------

MARGIN_S = 60  # every wait gives up this long before pytest's timeout would stop the test
_clock: dict[str, float] = {}  # set as each test starts


def pytest_runtest_setup(item):
    """Start the clock of the test about to run (its fixtures included, as pytest-timeout counts them)."""
    marker = item.get_closest_marker("timeout")  # a test's own @pytest.mark.timeout(S) wins over the ini's
    try:
        timeout = float(marker.args[0] if marker and marker.args else item.config.getini("timeout") or 600)
    except ValueError:  # pytest-timeout not installed
        timeout = 600.0
    _clock.update(started=time.monotonic(), timeout=timeout)


def _limit(seconds: float) -> float:
    """``seconds``, or less when the test would otherwise run into pytest's timeout."""
    if not _clock:
        return seconds
    left = _clock["timeout"] - MARGIN_S - (time.monotonic() - _clock["started"])
    return max(1.0, min(seconds, left))


def wait_for(condition: Callable, what: str, timeout: float, interval: float = 0.01):
    """Poll ``condition`` until it returns something true (returned); fail naming ``what`` after ``timeout`` s."""
    limit = _limit(timeout)
    start = time.monotonic()
    while not (value := condition()):
        if time.monotonic() - start > limit:
            pytest.fail(f"gave up after {limit:.0f} s waiting for {what} (a slow machine, or a hang)", pytrace=False)
        time.sleep(interval)
    return value


def finish_process(process: subprocess.Popen, what: str, timeout: float) -> tuple[str, str]:
    """``process.communicate()`` within ``timeout`` s; past it, kill the process (its group, if it leads one) and
    fail naming ``what``, with the end of what it printed."""
    limit = _limit(timeout)
    try:
        out, err = process.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the CLI and what it started (Prefect's server)
        except (ProcessLookupError, PermissionError):
            process.kill()
        out, err = process.communicate()
        tail = err[-2000:] if isinstance(err, str) else ""
        pytest.fail(f"gave up after {limit:.0f} s waiting for {what} to finish (a slow machine, or a hang); "
                    f"it printed:\n{tail}", pytrace=False)
    return out or "", err or ""


@pytest.fixture(scope="session")
def demo_corpus(tmp_path_factory) -> Path:
    """The README demo corpus (real text installed with Python), built once per test run."""
    from atlas.tools.demo_corpus import build_demo_corpus

    path, _ = build_demo_corpus(tmp_path_factory.mktemp("demo") / "corpus.jsonl")
    return path


@pytest.fixture(scope="session")
def demo_records(demo_corpus) -> list[dict]:
    return [json.loads(line) for line in demo_corpus.read_text().splitlines()]


@pytest.fixture(scope="session")
def dev_corpus() -> Path:
    path = SHARED_DATA / "corpus.parquet"
    if not path.exists():
        pytest.skip(f"{path} is absent (the shared dev data sits beside the repository)")
    return path


@pytest.fixture(scope="session")
def prefect_harness():
    """One temporary Prefect backend for the whole test run (starting one costs seconds)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=None):  # None: use the env timeout above, not 30 s
        yield


BUCKET = "atlas-test"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """An S3 server on loopback, and the AWS variables that point Atlas at it (as a MinIO user would set them);
    yields an s3fs filesystem on it."""
    import fsspec
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    no_config = tmp_path_factory.mktemp("aws") / "absent"  # a developer's ~/.aws must not change what is tested
    with pytest.MonkeyPatch.context() as env:
        for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://{host}:{port}",
                            "AWS_CONFIG_FILE": str(no_config), "AWS_SHARED_CREDENTIALS_FILE": str(no_config)}.items():
            env.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            env.delenv(name, raising=False)
        fs = fsspec.filesystem("s3", endpoint_url=f"http://{host}:{port}")
        fs.makedirs(BUCKET, exist_ok=True)  # moto keeps its buckets per process, across servers
        yield fs
    server.stop()


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def write_config(tmp_path: Path, input_path: Path, **sections) -> Path:
    """A run config in tmp_path reading input_path; keyword arguments add or replace sections."""
    config = {
        "name": "test",
        "run_dir": str(tmp_path / "run"),
        "input": {"path": str(input_path), "id_field": "id", "docs_per_shard": 10},
        "execution": {"orchestrator": "inline", "progress": False},
    }
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="session")
def trained(tmp_path_factory, demo_records):
    """A small offline run through train_annotator (30 documents of three sources, labelled by source)."""
    from atlas.config import load_config
    from atlas.core.rundir import RunDir
    from atlas.runner import run_stages

    folder = tmp_path_factory.mktemp("annotator")
    sources = ("python-docs", "python-math-docs", "python-stdlib")
    picked = [r for source in sources for r in [d for d in demo_records if d["data_src"] == source][:10]]
    # Each text cut to its first 6,000 characters: whole, seven stdlib modules of 20,000 were most of the chunks and
    # of the fixture's time (tagging and embedding them on CPU); cut, the library still has concepts of each source.
    docs = write_jsonl(folder / "docs.jsonl", [dict(r, text=r["text"][:6_000], label=r["data_src"]) for r in picked])
    annotator = {"epochs": 5, "hidden": 32, "judge_sample": 5, "min_per_concept": 2}
    # 30 documents of three close sources: few clusters reach the paper's tag-set thresholds against a null drawn
    # from their own few hundred tags; lower ones keep enough concepts to train on
    library = {"ks": [8, 16], "core_min": 7, "random_min": 7, "edge_min": 1}
    config = load_config(write_config(folder, docs, input={"metadata_fields": ["label"]}, library=library,
                                      tag={"batch_size": 64}, annotator=annotator))
    run_stages(config, ["chunk", "tag", "vocab", "cluster", "coherence", "label", "library", "targets",
                        "train_annotator"], log=lambda m: None)
    return config, RunDir(config.run_dir)


def copy_run_dir(source: Path, root: Path) -> Path:
    """A copy of the run directory ``source`` (with its caches) at ``root``, whose manifest points at the copy."""
    import shutil

    shutil.copytree(source, root)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["config"]["run_dir"] = str(root)
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


@pytest.fixture
def run_copy(trained, tmp_path):
    """A private copy of the trained run (with its embedding cache), whose manifest points at the copy."""
    return copy_run_dir(trained[1].root, tmp_path / "run")


# Tiny storage chunks and blocks, so that shards share storage chunks and blocks split shards.
SMALL = {"annotate": {"zarr_chunk_rows": 7, "block_rows": 5}, "tokenize": {"block_rows": 6}}


@pytest.fixture(scope="session")
def annotated_run(trained, tmp_path_factory):
    """A copy of the trained run, annotated and tokenized with SMALL, built once per test run (annotating every
    chunk takes tens of seconds). Never changed: a test that changes it works on a copy (``copy_run_dir``)."""
    from atlas.config import config_from_dict
    from atlas.core.rundir import RunDir
    from atlas.runner import run_stages

    config, run = trained
    root = copy_run_dir(run.root, tmp_path_factory.mktemp("annotated") / "run")
    data = config.model_dump() | {"run_dir": str(root)}
    config = config_from_dict(data | {key: {**data[key], **value} for key, value in SMALL.items()})
    run_stages(config, ["annotate", "tokenize"], log=lambda m: None)
    return config, RunDir(root)
