"""The Prefect flow and a SIGKILL in the middle of `atlas run`."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import finish_process, wait_for, write_config, write_jsonl
from test_run import outputs

from atlas.config import load_config
from atlas.runner import StageFailed, run_one_shard, run_stages

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def larger_input(tmp_path_factory, demo_records) -> Path:
    """About 1,400 real documents (the demo corpus ten times, under new ids): long enough to kill mid-run."""
    folder = tmp_path_factory.mktemp("larger")
    records = [dict(r, id=f"{r['id']}#{copy}") for copy in range(10) for r in demo_records]
    return write_jsonl(folder / "docs.jsonl", records)


@pytest.fixture(scope="module")
def reference_outputs(tmp_path_factory, larger_input) -> dict:
    folder = tmp_path_factory.mktemp("reference")
    run_stages(load_config(write_config(folder, larger_input, input={"docs_per_shard": 20})), ["chunk"],
               log=lambda m: None)
    return outputs(folder / "run")


def test_prefect_flow_gives_the_same_outputs_as_the_inline_loop(tmp_path, larger_input, reference_outputs,
                                                                prefect_harness):
    from flows.pipeline import run_with_prefect

    config = load_config(write_config(tmp_path, larger_input, input={"docs_per_shard": 20},
                                      execution={"orchestrator": "prefect", "workers": 2}))
    [report] = run_with_prefect(config, ["chunk"])
    assert report.num_shards == 72 and len(report.ran) == 72
    assert outputs(tmp_path / "run") == reference_outputs

    # What the Prefect UI shows: one completed task run per shard, and `atlas status` as artifacts.
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import TaskRunSort

    async def read_back():
        async with get_client() as client:
            latest = await client.read_task_runs(sort=TaskRunSort.EXPECTED_START_TIME_DESC, limit=72)
            # POSTed by hand: this Prefect's client sends null filters that its own server rejects
            body = {"artifacts": {"key": {"any_": ["atlas-status", "atlas-chunk"]}}, "sort": "CREATED_DESC",
                    "limit": 50}
            response = await client._client.post("/artifacts/filter", json=body)
            return latest, response.json()
    def all_recorded():
        """The server records task states and artifacts a moment after the flow returns: read until they are in."""
        latest, artifacts = asyncio.run(read_back())
        names = {t.name: t.state_name for t in latest}
        complete = ({f"chunk-{i:05d}" for i in range(72)} == set(names) and set(names.values()) == {"Completed"}
                    and any(a["key"] == "atlas-status" and str(tmp_path) in a["description"] for a in artifacts))
        return (latest, artifacts) if complete else None

    latest, artifacts = wait_for(all_recorded, "the Prefect server to record 72 completed task runs and the status "
                                 "artifact", 30, interval=0.5)
    table = next(a for a in artifacts if a["key"] == "atlas-status" and str(tmp_path) in a["description"])
    chunk_row = next(row for row in json.loads(table["data"]) if row["stage"] == "chunk")
    assert chunk_row["state"] == "done" and chunk_row["shards"] == "72/72"
    assert any(a["key"] == "atlas-chunk" and "docs_in" in a["data"] for a in artifacts)


def test_sigkill_during_chunking_then_rerun_gives_identical_outputs(tmp_path, larger_input, reference_outputs):
    config_path = write_config(tmp_path, larger_input, input={"docs_per_shard": 20},
                               execution={"orchestrator": "prefect", "workers": 2, "progress": False})
    markers = tmp_path / "run" / "chunks" / "_shards"
    command = [sys.executable, "-m", "atlas.cli", "run", str(config_path), "--stages", "chunk"]
    env = dict(os.environ, PREFECT_SERVER_ANALYTICS_ENABLED="false")
    process = subprocess.Popen(command, env=env, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: process.poll() is not None or len(list(markers.glob("*.json"))) >= 5,
             "the Prefect run to finish 5 chunk shards (Prefect's temporary server starts first)", 240, interval=0.02)
    assert process.poll() is None, f"`atlas run` ended (exit status {process.returncode}) before 5 shards were done"
    os.killpg(process.pid, signal.SIGKILL)  # the whole group: the CLI and Prefect's temporary server
    finish_process(process, "the killed `atlas run` to exit", 60)
    done_at_kill = len(list(markers.glob("*.json")))
    assert 5 <= done_at_kill < 72, "the kill must land in the middle of chunking"
    assert not (tmp_path / "run" / "chunks" / "_SUCCESS").exists()

    rerun = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    out, err = finish_process(rerun, "the rerun after the kill", 300)
    assert rerun.returncode == 0, err
    assert f"{72 - done_at_kill} shard(s) to run, {done_at_kill} already done" in out + err
    assert outputs(tmp_path / "run") == reference_outputs
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["stages"]["chunk"]["status"] == "done"


def test_a_shard_task_that_fails_is_retried_before_its_shard_counts_as_failed(tmp_path, demo_records, prefect_harness,
                                                                             monkeypatch):
    import flows.pipeline as pipeline
    from flows.pipeline import run_with_prefect

    attempts = {0: 0, 1: 0, 2: 0}

    def flaky(config, stage_name, shard, stage_hash):  # shard 1 fails once, shard 2 every time
        attempts[shard] += 1
        if shard == 2 or (shard == 1 and attempts[1] == 1):
            raise OSError(f"transient failure of shard {shard}")
        return run_one_shard(config, stage_name, shard, stage_hash)

    monkeypatch.setattr(pipeline, "run_one_shard", flaky)
    docs = write_jsonl(tmp_path / "docs.jsonl", demo_records[:30])  # 3 shards of 10 documents
    config = load_config(write_config(tmp_path, docs, execution={
        "orchestrator": "prefect", "workers": 2, "shard_retries": 1, "shard_retry_delay_seconds": 0}))
    with pytest.raises(StageFailed, match=r"1 of 3 shard\(s\) failed") as failed:
        run_with_prefect(config, ["chunk"])
    assert "shard 00002: OSError: transient failure of shard 2" in str(failed.value)
    assert attempts == {0: 1, 1: 2, 2: 2}  # one retry each, and none for the shard that succeeded
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["stages"]["chunk"]["failed_shards"] == [2]
    assert sorted(p.name for p in (tmp_path / "run" / "chunks" / "_shards").glob("*.json")) == [
        "00000.json", "00001.json"]
