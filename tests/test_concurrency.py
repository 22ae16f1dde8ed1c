"""Real `atlas run` processes: two on one run directory, and Ctrl-C (SIGINT) in both orchestrators."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import finish_process, wait_for, write_config, write_jsonl

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def larger_input(tmp_path_factory, demo_records) -> Path:
    """About 1,400 real documents (the demo corpus ten times, under new ids): 72 chunk shards of 20 documents."""
    folder = tmp_path_factory.mktemp("larger")
    return write_jsonl(folder / "docs.jsonl", [dict(r, id=f"{r['id']}#{copy}") for copy in range(10)
                                               for r in demo_records])


def _default_ctrl_c() -> None:
    """A suite started in the background (`pytest &` in a script) ignores SIGINT, and children inherit that: Python
    then never turns Ctrl-C into KeyboardInterrupt. The commands under test get a terminal's default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def atlas(*args, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "atlas.cli", *map(str, args)], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_default_ctrl_c,
                            **popen)


def started_chunking(run_dir: Path, process: subprocess.Popen, shards: int = 1) -> bool:
    """Whether ``process`` drives the run (the manifest's driver) and has finished ``shards`` chunk shards."""
    if process.poll() is not None:
        pytest.fail(f"`atlas run` ended (exit status {process.returncode}) before it was interrupted:\n"
                    f"{process.stderr.read()[-3000:]}", pytrace=False)
    try:
        driver = json.loads((run_dir / "manifest.json").read_text()).get("driver", {})
    except (FileNotFoundError, ValueError):
        return False
    return driver.get("pid") == process.pid and len(list((run_dir / "chunks" / "_shards").glob("*.json"))) >= shards


def test_a_second_atlas_run_on_a_busy_run_directory_is_refused(tmp_path, larger_input):
    """Before: a second run (same config) computed every shard again; with another config and --force it cleared
    the first one's stage, which then wrote a record without hash: every later command died of KeyError: 'hash'."""
    config = write_config(tmp_path, larger_input, input={"docs_per_shard": 20}, execution={"progress": False})
    run_dir = tmp_path / "run"
    first = atlas("run", config, "--inline", "--stages", "chunk")
    try:
        wait_for(lambda: started_chunking(run_dir, first), "the first `atlas run` to start chunking", 120)
        os.kill(first.pid, signal.SIGSTOP)  # holds the run for as long as the second ones take
        lock = json.loads((run_dir / "_lock").read_text()) if (run_dir / "_lock").exists() else {}
        manifest = (run_dir / "manifest.json").read_bytes()
        for args in (["--inline", "--stages", "chunk"],
                     ["--inline", "--stages", "chunk", "--force", "--set", "chunk.max_sentence_tokens=300"],
                     ["--stages", "chunk", "--set", "execution.orchestrator=prefect"]):
            second = atlas("run", config, *args)
            out, err = finish_process(second, f"the second `atlas run {' '.join(args)}`", 120)
            assert second.returncode == 1 and "Traceback" not in err, err
            assert err.startswith(f"error: {run_dir} is in use by another atlas run (pid {first.pid} on host "
                                  f"{lock.get('host')}, started {lock.get('started')}: atlas run {config} --inline "
                                  f"--stages chunk); wait for it or, if that process is gone, remove "
                                  f"{run_dir / '_lock'}"), err
            assert (run_dir / "manifest.json").read_bytes() == manifest
        planned = atlas("plan", config)
        _, err = finish_process(planned, "`atlas plan`", 120)
        assert planned.returncode == 1 and f"{run_dir} is in use by another atlas run" in err, err
        os.kill(first.pid, signal.SIGCONT)
        out, err = finish_process(first, "the first `atlas run`", 240)
        assert first.returncode == 0, err
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.communicate()
    assert not (run_dir / "_lock").exists()
    status = atlas("status", run_dir)
    out, err = finish_process(status, "`atlas status`", 60)
    assert status.returncode == 0 and re.search(r"chunk +done +72/72", out), out + err
    records = json.loads((run_dir / "manifest.json").read_text())["stages"]
    assert all(record.get("hash") for record in records.values())


@pytest.mark.parametrize("orchestrator", ["inline", "prefect"])
def test_ctrl_c_stops_atlas_run_within_seconds_with_one_line(tmp_path, larger_input, orchestrator):
    """A real SIGINT to the process group, as a terminal's Ctrl-C sends it (with Prefect, to its temporary server
    too). Before: ~90 lines of traceback inline; with Prefect, minutes of httpx.ConnectError tracebacks, as the
    flow retried a server that the same Ctrl-C had stopped."""
    # shards of 4 documents (360): chunking takes long enough for the signal to land inside it on a fast machine
    config = write_config(tmp_path, larger_input, input={"docs_per_shard": 4},
                          execution={"orchestrator": orchestrator, "workers": 2, "progress": False})
    run_dir = tmp_path / "run"
    process = atlas("run", config, "--stages", "chunk")
    try:
        # Prefect's temporary server starts first: seconds, more on a busy machine.
        wait_for(lambda: started_chunking(run_dir, process, shards=2), f"`atlas run` ({orchestrator}) to chunk", 120)
        os.killpg(process.pid, signal.SIGINT)
        signalled = time.monotonic()
        out, err = finish_process(process, "`atlas run` after Ctrl-C", 60)
        seconds = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert seconds < 20, f"took {seconds:.1f} s to exit after Ctrl-C"
    assert process.returncode == 130, err
    assert "Traceback" not in err and "ConnectError" not in err, err
    ours = [line for line in err.splitlines() if line.startswith("interrupted:")]
    assert len(ours) == 1 and (orchestrator == "prefect" or err == ours[0] + "\n"), err  # Prefect logs its own lines
    done = len(list((run_dir / "chunks" / "_shards").glob("*.json")))
    assert ours[0].startswith("interrupted: stage chunk (") and ours[0].endswith(
        " of 360 shard(s) done); finished shards are kept, rerun the same command to resume"), ours
    assert 2 <= int(ours[0].split("(")[1].split()[0]) <= done < 360
    assert not (run_dir / "_lock").exists()
    status = atlas("status", run_dir)
    out, _ = finish_process(status, "`atlas status`", 60)
    assert re.search(r"chunk +interrupted", out), out
