"""What a refused command leaves behind (nothing) and says (one line, no traceback): refused runs, the run lock,
half manifest records left by older versions, and arguments that cannot work."""

import json
import os
import socket
import subprocess
import sys

import pytest
import yaml
from conftest import write_config, write_jsonl

from atlas.cli import main
from atlas.core.rundir import RunDir


def snapshot(folder) -> dict:
    """Every file and folder under ``folder``, each file with its bytes and modification time (a file rewritten with
    the same bytes was still rewritten): a refused command must leave them all as they were."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
            for p in sorted(folder.rglob("*"))}


def cli(argv: list[str], capsys) -> tuple[int, str]:
    """Exit status and standard error of `atlas ARGV`, run in this process (argparse errors included)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    return code, capsys.readouterr().err


@pytest.fixture()
def finished(tmp_path, demo_records, capsys):
    """A run directory whose chunk stage is done (report included), and its config."""
    config = write_config(tmp_path, write_jsonl(tmp_path / "docs.jsonl", demo_records[:12]))
    assert main(["run", str(config), "--inline", "--stages", "chunk"]) == 0
    assert (tmp_path / "run" / "report" / "index.html").exists()
    capsys.readouterr()
    return config, tmp_path / "run"


@pytest.mark.parametrize("args, code, said", [
    (["--inline", "--stages", "chunk", "--set", "chunk.max_sentence_tokens=300"], 2,
     "already holds stage 'chunk' computed with a different configuration or input"),
    (["--stages", "chunk", "--set", "chunk.max_sentence_tokens=300", "--set", "execution.orchestrator=prefect"], 2,
     "already holds stage 'chunk' computed with a different configuration or input"),
    (["--inline", "--stages", "nope"], 2, "unknown stage(s) ['nope']"),
    (["--inline", "--stages", "chunk", "--input", "/nonexistent/docs.jsonl"], 1, "input not found"),
    (["--inline", "--stages", "vocab"], 1, "vocab: needs stage(s) ['tag'] first"),
], ids=["conflict", "conflict-prefect", "unknown-stage", "missing-input", "upstream-never-ran"])
def test_a_refused_run_leaves_the_run_directory_byte_identical(finished, args, code, said, capsys):
    config, run_dir = finished
    before = snapshot(run_dir)
    status, err = cli(["run", config, *args], capsys)
    assert status == code and said in err and "Traceback" not in err, err
    assert snapshot(run_dir) == before  # no manifest write, no driver record, no report, no lock left behind


def test_a_refused_run_creates_no_run_directory(tmp_path, demo_records, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    status, err = cli(["run", empty, "--inline"], capsys)
    assert status == 1 and "no input: set input.path" in err
    assert not (tmp_path / "runs").exists()  # the default run_dir, runs/atlas beside the config
    config = write_config(tmp_path, write_jsonl(tmp_path / "docs.jsonl", demo_records[:3]))
    status, err = cli(["run", config, "--inline", "--stages", "chunk,nope"], capsys)
    assert status == 2 and "unknown stage(s) ['nope']" in err
    assert not (tmp_path / "run").exists()


# --- the run lock ----------------------------------------------------------------------------------------


def write_lock(run_dir, pid: int, host: str | None = None) -> None:
    lock = {"pid": pid, "host": host or socket.gethostname(), "started": "2026-01-01T00:00:00+0000",
            "command": "atlas run other.yaml"}
    (run_dir / "_lock").write_text(json.dumps(lock))


def test_a_run_directory_locked_by_a_live_process_is_refused_and_left_alone(finished, capsys):
    config, run_dir = finished
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        write_lock(run_dir, sleeper.pid)
        before = snapshot(run_dir)
        for command in (["run", config, "--inline", "--stages", "chunk"],
                        ["run", config, "--stages", "chunk", "--set", "execution.orchestrator=prefect"],
                        ["run", config, "--inline", "--stages", "chunk", "--force"], ["plan", config]):
            status, err = cli(command, capsys)
            assert status == 1 and "Traceback" not in err, (command, err)
            assert err == (f"error: {run_dir} is in use by another atlas run (pid {sleeper.pid} on host "
                           f"{socket.gethostname()}, started 2026-01-01T00:00:00+0000: atlas run other.yaml); wait "
                           f"for it or, if that process is gone, remove {run_dir / '_lock'}\n")
            assert snapshot(run_dir) == before
        # Reading commands take no lock.
        assert cli(["status", run_dir], capsys)[0] == 0
        assert cli(["inspect", run_dir, "chunks", "-n", "1"], capsys)[0] == 0
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_lock_of_another_host_is_never_broken(finished, capsys):
    config, run_dir = finished
    write_lock(run_dir, 1, host="gpu-node-7")
    status, err = cli(["run", config, "--inline", "--stages", "chunk"], capsys)
    assert status == 1 and "in use by another atlas run (pid 1 on host gpu-node-7" in err
    assert f"if that process is gone, remove {run_dir / '_lock'}" in err
    assert json.loads((run_dir / "_lock").read_text())["host"] == "gpu-node-7"


def test_a_stale_lock_of_a_dead_process_is_taken_over_and_released(finished, capsys):
    config, run_dir = finished
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_lock(run_dir, dead.pid)
    status, err = cli(["run", config, "--inline", "--stages", "chunk"], capsys)
    assert status == 0, err
    assert f"note: {run_dir / '_lock'} was left by pid {dead.pid} on this host, which is no longer running" in err
    assert not (run_dir / "_lock").exists()


def test_slurm_array_tasks_take_no_lock(tmp_path, demo_records, capsys):
    """`atlas stage` runs while `atlas plan`'s lock is still held elsewhere: the array tasks of a plan never wait."""
    config = write_config(tmp_path, write_jsonl(tmp_path / "docs.jsonl", demo_records[:25]))
    assert main(["plan", str(config), "--stages", "chunk"]) == 0
    run_dir = tmp_path / "run"
    assert not (run_dir / "_lock").exists()  # released
    write_lock(run_dir, os.getppid())  # a live process of this host
    for shard in range(3):
        assert cli(["stage", "chunk", "--run-dir", run_dir, "--shard", shard], capsys)[0] == 0
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert all(RunDir(run_dir).is_shard_done("chunks", s, manifest["stages"]["chunk"]["hash"]) for s in range(3))


# --- manifest records ---------------------------------------------------------------------------------------


def test_a_half_stage_record_is_not_done_and_never_a_key_error(finished, capsys):
    """Older versions wrote a stage record without its hash when two runs shared a directory; every command
    then died with KeyError: 'hash'. Now the stage counts as not done, and --force recomputes it."""
    config, run_dir = finished
    manifest = json.loads((run_dir / "manifest.json").read_text())
    del manifest["stages"]["chunk"]["hash"]
    (run_dir / "manifest.json").write_text(json.dumps(manifest))

    assert cli(["status", run_dir], capsys)[0] == 0
    status, err = cli(["run", config, "--inline", "--stages", "chunk"], capsys)
    assert status == 2 and "the manifest's record of stage 'chunk' is incomplete (no hash" in err
    assert "--force --stages chunk" in err
    with pytest.raises(SystemExit, match="stage 'chunk' is not planned"):
        main(["stage", "chunk", "--run-dir", str(run_dir), "--shard", "0"])
    assert cli(["run", config, "--inline", "--stages", "chunk", "--force"], capsys)[0] == 0
    record = json.loads((run_dir / "manifest.json").read_text())["stages"]["chunk"]
    assert record["status"] == "done" and record["hash"] and record["identity"]


def test_status_shows_a_half_record_as_unknown(finished, capsys):
    _, run_dir = finished
    manifest = json.loads((run_dir / "manifest.json").read_text())
    del manifest["stages"]["chunk"]["hash"]
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    assert main(["status", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "chunk            unknown" in out and "recompute it with atlas run CONFIG --force --stages chunk" in out
    assert main(["report", str(run_dir)]) == 0


def test_a_stage_record_is_written_whole_or_not_at_all(finished):
    _, run_dir = finished
    run = RunDir(run_dir)
    before = (run_dir / "manifest.json").read_bytes()
    with pytest.raises(RuntimeError, match="stage 'tag' has no record to update"):
        run.update_stage("tag", status="done", counters={})  # what a run whose record was cleared by another did
    assert (run_dir / "manifest.json").read_bytes() == before


# --- arguments that cannot work -----------------------------------------------------------------------------


@pytest.mark.parametrize("argv, said", [
    (["run", "CONFIG", "--inline", "--set", "chunk.max_sentence_tokens=[1"],
     "error: --set 'chunk.max_sentence_tokens=[1': the value '[1' is not valid YAML (expected ',' or ']', but got "
     "'<stream end>'); quote it to pass a string"),
    (["inspect", "RUN", "../x"], "error: '../x' is not an output folder; inspect one of: chunks, tags, tag_vocab"),
    (["stage", "chunk", "--run-dir", "RUN", "--shard", "0", "--num-shards", "0"],
     "atlas stage: error: argument --num-shards: must be at least 1, got 0"),
    (["stage", "chunk", "--run-dir", "RUN", "--shard", "-1"],
     "atlas stage: error: argument --shard: must be at least 0, got -1"),
    (["stage", "chunk", "--run-dir", "RUN", "--shard", "7"],
     "error: --shard 7 selects none of the 3 shard(s) of stage 'chunk': its tasks are 0 to 2; size the SLURM "
     "array to the plan (--array=0-2)"),
    (["stage", "chunk", "--run-dir", "RUN", "--shard", "4", "--num-shards", "5"],
     "error: --shard 4 selects none of the 3 shard(s) of stage 'chunk': its tasks are 0 to 2"),
], ids=["set-yaml", "inspect-outside", "num-shards-0", "shard-negative", "shard-7-of-3", "array-too-large"])
def test_arguments_that_cannot_work_say_why_and_fail(tmp_path, demo_records, argv, said, capsys):
    config = write_config(tmp_path, write_jsonl(tmp_path / "docs.jsonl", demo_records[:25]))
    assert main(["plan", str(config), "--stages", "chunk"]) == 0  # 3 shards
    capsys.readouterr()
    argv = [{"CONFIG": str(config), "RUN": str(tmp_path / "run")}.get(a, a) for a in argv]
    status, err = cli(argv, capsys)
    assert status == 2 and said in err and "Traceback" not in err, err
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())  # untouched
