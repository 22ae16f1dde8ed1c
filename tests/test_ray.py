"""The Ray task runner (prefect-ray, the `cluster` extra): same outputs as the inline loop; GPU requests."""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("prefect_ray")

from conftest import wait_for, write_config, write_jsonl  # noqa: E402
from test_run import outputs  # noqa: E402

from atlas.config import load_config  # noqa: E402
from atlas.core.files import stable_hash  # noqa: E402
from atlas.runner import _WORKER_STAGES, run_stages  # noqa: E402


def test_ray_gpus_become_the_gpus_of_that_stages_actors_and_shard_tasks_retry(monkeypatch):
    import flows.pipeline as pipeline

    execution = {"task_runner": "ray", "ray_gpus": {"tag": 1, "annotate": 0.5}, "progress": False,
                 "shard_retries": 2, "shard_retry_delay_seconds": 0.5}
    assert pipeline.ray_remote_options(execution, "tag") == {"num_gpus": 1}
    assert pipeline.ray_remote_options(execution, "annotate") == {"num_gpus": 0.5}
    assert pipeline.ray_remote_options(execution, "chunk") == {}
    assert pipeline.ray_remote_options(dict(execution, task_runner="threads"), "tag") == {}  # Ray only

    # A stage without GPUs maps plain shard tasks, with the configured Prefect retries.
    seen = {}

    class FakeTask:
        def with_options(self, **options):
            seen["options"] = options
            return self

        def map(self, config, stage_name, shards, stage_hash):
            seen["mapped"] = stage_name.value
            return []

    monkeypatch.setattr(pipeline, "shard_task", FakeTask())
    assert pipeline.map_with_prefect({"execution": execution}, "chunk", [], "hash") == []
    assert seen == {"options": {"retries": 2, "retry_delay_seconds": 0.5}, "mapped": "chunk"}


@pytest.mark.slow
def test_ray_task_runner_gives_the_same_chunks_as_the_inline_loop(tmp_path, demo_records, prefect_harness):
    from flows.pipeline import run_with_prefect

    docs = write_jsonl(tmp_path / "docs.jsonl", demo_records[:60])  # 6 shards of 10 documents
    (tmp_path / "inline").mkdir()
    inline = load_config(write_config(tmp_path / "inline", docs))
    run_stages(inline, ["chunk"], log=lambda m: None)

    (tmp_path / "ray").mkdir()
    config = load_config(write_config(tmp_path / "ray", docs, execution={
        "orchestrator": "prefect", "task_runner": "ray", "workers": 2, "ray_address": None}))
    [report] = run_with_prefect(config, ["chunk"])  # starts and stops a local Ray instance of 2 CPUs

    assert report.num_shards == 6 and sorted(report.ran) == list(range(6))
    assert outputs(tmp_path / "ray" / "run") == outputs(tmp_path / "inline" / "run")
    # The shards ran in Ray workers, not here: this process never built the chunk stage of that config.
    assert ("chunk", stable_hash(config.model_dump())) not in _WORKER_STAGES


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        return s.getsockname()[1]


def _start_ray_node(args: list[str], env: dict, log: Path, what: str) -> subprocess.Popen:
    """`ray start ... --block` in a session of its own: stopping it is killing that session, and only it."""
    process = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--block", *args], env=env,
                               stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    wait_for(lambda: process.poll() is not None or "Ray runtime started" in log.read_text(), what, 180, 0.1)
    assert process.poll() is None, f"{what} failed (exit {process.returncode}):\n{log.read_text()[-3000:]}"
    return process


def _stop(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)  # `ray start --block` stops the node's processes, then exits
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # whatever of that node is left (its session only)


@pytest.mark.slow
def test_a_two_node_ray_cluster_started_with_ray_start_runs_tasks_on_both_and_gpu_stages_on_actors(
        tmp_path, demo_records, prefect_harness, monkeypatch):
    """A head and a worker node on loopback (`ray start`, 1 CPU and 1 fake GPU each), joined through
    execution.ray_address: the same chunks as the inline loop, shards on both nodes; with ray_gpus, the stage's
    shards run on 2 long-lived actors (2 processes set the stage up, not one per shard)."""
    import ray

    from flows.pipeline import run_with_prefect

    docs = write_jsonl(tmp_path / "docs.jsonl", demo_records[:60])  # 6 shards of 10 documents
    (tmp_path / "inline").mkdir()
    run_stages(load_config(write_config(tmp_path / "inline", docs)), ["chunk"], log=lambda m: None)

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # as conftest.py sets it: the nodes and this driver agree
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    # Stopped by SIGTERM, a node first drains for Ray Serve's sake: up to 30 s, which the head, its GCS going down
    # with it, always waits out. Nothing here runs on the nodes by then; 0 stops them at once.
    monkeypatch.setenv("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
    env = dict(os.environ)
    port = _free_port()
    # 127.0.0.2, not 127.0.0.1: Ray swaps "localhost" addresses for the host's network address, and this test's
    # traffic must stay on loopback (127.0.0.0/8).
    address = f"127.0.0.2:{port}"
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 characters
    node = ["--node-ip-address=127.0.0.2", "--num-cpus=1", "--num-gpus=1", "--disable-usage-stats"]
    nodes = []
    try:
        nodes.append(_start_ray_node(["--head", f"--port={port}", "--include-dashboard=false",
                                      f"--temp-dir={temp_dir}", *node], env, tmp_path / "head.log",
                                     "`ray start --head` to start the head node"))
        nodes.append(_start_ray_node([f"--address={address}", *node], env, tmp_path / "worker.log",
                                     "`ray start --address` to start a second node"))

        def shard_markers(folder):
            return [json.loads(p.read_text()) for p in sorted((folder / "run" / "chunks" / "_shards").glob("*.json"))]

        runs = {}
        for name, extra in (("tasks", {}), ("actors", {"ray_gpus": {"chunk": 1}})):
            (tmp_path / name).mkdir()
            config = load_config(write_config(tmp_path / name, docs, execution={
                "orchestrator": "prefect", "task_runner": "ray", "ray_address": address, **extra}))
            [report] = run_with_prefect(config, ["chunk"])
            assert report.num_shards == 6 and sorted(report.ran) == list(range(6)), name
            assert outputs(tmp_path / name / "run") == outputs(tmp_path / "inline" / "run"), name
            runs[name] = [m["worker"] for m in shard_markers(tmp_path / name)]

        ray.init(address=address)
        try:
            alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            assert {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]} == {"127.0.0.2"}  # loopback only
        finally:
            ray.shutdown()
        assert len(alive) == 2
        assert {w["ray_node"] for w in runs["tasks"]} == alive, runs["tasks"]  # shards ran on both nodes
        # Two actors (the cluster's two GPUs), one per node: the stage was set up in 2 processes for 6 shards.
        processes = {(w["ray_node"], w["pid"]) for w in runs["actors"]}
        assert len(processes) == 2 and {n for n, _ in processes} == alive, runs["actors"]
    finally:
        for process in reversed(nodes):
            _stop(process)
        shutil.rmtree(temp_dir, ignore_errors=True)
