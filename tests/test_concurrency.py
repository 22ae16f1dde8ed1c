"""Real `atlas run` processes: two on one run directory, and Ctrl-C (SIGINT) in both orchestrators."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import finish_process, wait_for, write_config, write_jsonl

from atlas.core.lock import run_lock, shard_running
from atlas.core.signals import Terminated, sigterm_as_interrupt

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


def chunking_run(tmp_path: Path, larger_input: Path, orchestrator: str) -> tuple[subprocess.Popen, Path]:
    """`atlas run --stages chunk` started on 360 shards of 4 documents: chunking takes long enough for a signal to
    land inside it on a fast machine. Returns the process and its run directory."""
    config = write_config(tmp_path, larger_input, input={"docs_per_shard": 4},
                          execution={"orchestrator": orchestrator, "workers": 2, "progress": False})
    return atlas("run", config, "--stages", "chunk"), tmp_path / "run"


@pytest.mark.parametrize("orchestrator", ["inline", "prefect"])
def test_ctrl_c_stops_atlas_run_within_seconds_with_one_line(tmp_path, larger_input, orchestrator):
    """A real SIGINT to the process group, as a terminal's Ctrl-C sends it (with Prefect, to its temporary server
    too). Before: ~90 lines of traceback inline; with Prefect, minutes of httpx.ConnectError tracebacks, as the
    flow retried a server that the same Ctrl-C had stopped."""
    process, run_dir = chunking_run(tmp_path, larger_input, orchestrator)
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


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("orchestrator", ["inline", "prefect"])
def test_sigterm_to_atlas_run_stops_it_and_what_it_started(tmp_path, larger_input, orchestrator):
    """`kill PID` (or a batch scheduler's time limit) signals the CLI alone, not its process group. Before: inline,
    the CLI died at once (no line, the lock left behind); with Prefect, its tasks ran on for over a minute, and its
    temporary server (uvicorn, about 200 MB) outlived it, one more at each such stop."""
    process, run_dir = chunking_run(tmp_path, larger_input, orchestrator)
    try:
        wait_for(lambda: started_chunking(run_dir, process, shards=2), f"`atlas run` ({orchestrator}) to chunk", 120)
        os.kill(process.pid, signal.SIGTERM)
        out, err = finish_process(process, "`atlas run` after SIGTERM", 60)
        wait_for(lambda: not _group_alive(process.pid), "what `atlas run` started to stop", 30, interval=0.2)
    finally:
        if _group_alive(process.pid):
            os.killpg(process.pid, signal.SIGKILL)
        if process.poll() is None:
            process.communicate()
    assert process.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err, err
    assert [line for line in err.splitlines() if line.startswith("terminated:")], err
    assert not (run_dir / "_lock").exists()


def test_sigterm_raises_terminated_within_the_block_and_nested_blocks_only_inside_one():
    before = signal.getsignal(signal.SIGTERM)
    with sigterm_as_interrupt(nested=True):  # a flow that a Prefect worker runs: the engine's handler stays
        assert signal.getsignal(signal.SIGTERM) is before
    with sigterm_as_interrupt():  # the CLI
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as Prefect's flow engine replaces it for the flow
        with sigterm_as_interrupt(nested=True), pytest.raises(Terminated):  # the flow body takes it back
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_interrupted_driver_holds_the_run_lock_until_its_running_shards_end(tmp_path):
    """A shard running in a worker thread cannot be stopped: interrupted, the driver keeps the lock until it ends.
    Before, a second SIGTERM while Prefect waited for its tasks let the lock go, and a second `atlas run` started
    on the run while the first still tagged (two drivers on the dev corpus)."""
    started, finish, outcome = threading.Event(), threading.Event(), {}

    def shard():
        with shard_running():
            started.set()
            finish.wait(60)

    def driver():
        try:
            with run_lock(tmp_path, "atlas run"):
                threading.Thread(target=shard).start()
                started.wait(60)
                raise Terminated
        except Terminated:
            outcome["raised"] = True

    thread = threading.Thread(target=driver)
    thread.start()
    assert started.wait(60)
    time.sleep(0.5)  # the driver is past its block, in the lock's way out
    assert thread.is_alive() and (tmp_path / "_lock").exists()
    finish.set()
    thread.join(60)
    assert outcome == {"raised": True} and not (tmp_path / "_lock").exists()
