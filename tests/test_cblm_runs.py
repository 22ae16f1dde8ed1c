"""`atlas cblm train` as a run: one trainer per model at a time, a resume after kill -9 that reaches the uninterrupted
run's weights and log exactly, settings checked and a user's files kept before anything is deleted."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from conftest import finish_process, wait_for
from safetensors.torch import load_file
from test_cblm import TINY, one_thread, tiny_run  # noqa: F401  (fixtures: the tiny run, one thread)

from atlas.cblm.train import RANGES, SettingError, TrainConfig, train
from atlas.cli import main


def cli_train(run: Path, name: str, settings: list[str], *extra: str) -> list[str]:
    return ["cblm", "train", str(run), "--name", name, *[x for s in settings for x in ("--set", s)], *extra]


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path -> sha256 of its bytes)."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


# --- a resume in another process, after kill -9 ------------------------------------------------------------------

# Trains in its own process with four threads (torch's parallel CPU kernels; more threads than cores make their
# order vary most), killing itself with SIGKILL when the log says ``kill_at``: no finally block, no lock released,
# log lines past the last checkpoint.
CHILD = r"""
import json, os, signal, sys
import torch
torch.set_num_threads(4)
from atlas.cblm.train import TrainConfig, train
run, settings, kill_at = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]

def log(message):
    if kill_at and message.startswith(kill_at):
        os.kill(os.getpid(), signal.SIGKILL)

train(TrainConfig.from_overrides(run, settings), log=log)
"""

# Wide enough (batch x seq_len x d_model = 65,536) that the steering step's gather of concept directions runs
# torch's multi-threaded CPU kernels, small enough for seconds; steering phases at steps 3-4, 5-6 and 7-8.
STEERED = ["d_model=128", "n_head=2", "n_layer=1", "seq_len=16", "batch_size=32", "unknown_rank=4",
           "eval_batches=1", "max_steps=12", "checkpoint_every=4", "eval_every=1", "log_every=1", "steering=true",
           "steering_phases=3", "steering_phase_frac=0.17", "alpha_warm_frac=0.25", "decay_frac=0.25"]


def run_child(run: Path, settings: list[str], hash_seed: int, kill_at: str = "") -> int:
    process = subprocess.Popen([sys.executable, "-c", CHILD, str(run), json.dumps(settings), kill_at],
                               env={**os.environ, "PYTHONHASHSEED": str(hash_seed)}, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = finish_process(process, "a training process", timeout=120)
    assert process.returncode in (0, -signal.SIGKILL), err[-2000:]
    return process.returncode


def test_a_resume_after_kill_9_in_another_process_reaches_the_same_weights_and_log(tiny_run):  # noqa: F811
    """Killed (SIGKILL) inside a steering phase two steps past its last checkpoint, and resumed by another process
    with another PYTHONHASHSEED, a run ends with the weights of a run uninterrupted (in this process, with its own
    hash seed), bit for bit, and its log: each step once. (Gathered by indexing, the steering step's concept
    directions had a backward that adds with parallel atomics in thread order: the weights came out ~1e-6 apart.)"""
    torch.set_num_threads(4)  # as the children (the one_thread fixture puts it back)
    train(TrainConfig.from_overrides(str(tiny_run), STEERED + ["name=whole"]), log=lambda m: None)
    assert run_child(tiny_run, STEERED + ["name=parts"], hash_seed=2, kill_at="step 6: val loss") == -signal.SIGKILL
    parts = tiny_run / "cblm" / "parts"
    assert json.loads((parts / "checkpoint" / "state.json").read_text())["step"] == 4
    assert [json.loads(line)["step"] for line in (parts / "log.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    assert (parts / "_lock").exists()  # the killed process could not let go of its lock
    assert run_child(tiny_run, STEERED + ["name=parts"], hash_seed=3) == 0  # takes the stale lock over

    whole = tiny_run / "cblm" / "whole"
    a, b = (load_file(folder / "checkpoint" / "model.safetensors") for folder in (whole, parts))
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    steps = [json.loads(line)["step"] for line in (parts / "log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))  # steps 5 and 6, logged before the kill and trained again, appear once
    assert (parts / "log.jsonl").read_text() == (whole / "log.jsonl").read_text()
    timing = ("train_seconds", "tokens_per_second")
    assert ({k: v for k, v in json.loads((parts / "metrics.json").read_text()).items() if k not in timing}
            == {k: v for k, v in json.loads((whole / "metrics.json").read_text()).items() if k not in timing})
    assert not (parts / "_lock").exists()


def test_a_resumed_log_has_each_step_once(tiny_run):  # noqa: F811
    """Interrupted (Ctrl-C) after logging steps past its last checkpoint, a run's log is cut back to the
    checkpoint's step on resume: no step twice, and the same records as an uninterrupted run."""
    settings = TINY + ["max_steps=6", "checkpoint_every=2", "eval_every=1", "steering=false"]
    train(TrainConfig.from_overrides(str(tiny_run), settings + ["name=log-whole"]), log=lambda m: None)

    def interrupt(message: str) -> None:
        if message.startswith("step 5: val loss"):
            raise KeyboardInterrupt

    config = TrainConfig.from_overrides(str(tiny_run), settings + ["name=log-parts"])
    with pytest.raises(KeyboardInterrupt):
        train(config, log=interrupt)
    folder = tiny_run / "cblm" / "log-parts"
    with open(folder / "log.jsonl", "a") as f:
        f.write('{"step": 6, "lr"')  # and a line cut short, as a kill in the middle of a write leaves it
    train(config, log=lambda m: None)
    lines = (folder / "log.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert lines == (tiny_run / "cblm" / "log-whole" / "log.jsonl").read_text().splitlines()


# --- one trainer per model --------------------------------------------------------------------------------------

def test_a_second_trainer_of_the_same_model_is_refused(tiny_run, capsys):  # noqa: F811
    """While `atlas cblm train` trains a model, a second one on the same model stops with a one-line error naming
    the first, and leaves its files alone; another --name trains beside it."""
    settings = TINY + ["max_steps=100000", "checkpoint_every=100000", "eval_every=100000", "steering=false"]
    folder = tiny_run / "cblm" / "busy"
    first = subprocess.Popen([sys.executable, "-m", "atlas.cli", *cli_train(tiny_run, "busy", settings)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        holder = wait_for(lambda: (folder / "_lock").exists() and json.loads((folder / "_lock").read_text()),
                          "the first trainer's lock", timeout=120)
        assert holder["pid"] == first.pid
        assert main(cli_train(tiny_run, "busy", settings)) == 1
        line = error_line(capsys)
        assert str(folder) in line and f"pid {first.pid}" in line and "in use" in line
        assert main(cli_train(tiny_run, "busy", settings, "--force")) == 1  # --force deletes nothing in use either
        error_line(capsys)
        assert first.poll() is None and not (folder / "checkpoint").exists()  # the first still trains, untouched
        assert main(cli_train(tiny_run, "beside", TINY + ["max_steps=1"])) == 0
    finally:
        first.send_signal(signal.SIGINT)
        finish_process(first, "the first trainer", timeout=60)
    assert not (folder / "_lock").exists()  # interrupted, it let go of its lock


# --- settings checked, a user's files kept ----------------------------------------------------------------------

@pytest.fixture
def trained_model(tiny_run):  # noqa: F811
    """A model of 2 steps (one per test, so that a test that deletes it harms no other)."""
    folder = tiny_run / "cblm" / "kept"
    shutil.rmtree(folder, ignore_errors=True)
    assert main(cli_train(tiny_run, "kept", TINY + ["max_steps=2"])) == 0
    return folder


@pytest.mark.parametrize("setting, says", [
    ("max_steps=-3", "max_steps must be >= 1"), ("batch_size=0", "batch_size must be >= 1"),
    ("checkpoint_every=0", "checkpoint_every must be >= 1"), ("lr=0", "lr must be > 0"),
    ("val_fraction=1", "val_fraction must be in [0, 1)"), ("p_eps=nan", "p_eps must be in [0, 1]"),
    ("seed=-1", "seed must be >= 0"), ("d_model=12.5", "expected an integer"),
    ("steering=maybe", "expected true or false"), ("objective=mlm", "expected one of ar, diffusion"),
    ("max_step=5", "no setting 'max_step'; the nearest is 'max_steps'"),
    ("chekpoint_every=5", "no setting 'chekpoint_every'; the nearest is 'checkpoint_every'"),
])
def test_a_wrong_setting_is_refused_before_the_model_is_touched(trained_model, tiny_run, capsys, setting, says):  # noqa: F811
    """A setting out of its range, of the wrong type or unknown (a typo: the nearest setting is named) stops
    `atlas cblm train` with one line, with or without --force, and the trained model's files are unchanged."""
    before = snapshot(trained_model)
    capsys.readouterr()
    for extra in ((), ("--force",)):
        assert main(cli_train(tiny_run, "kept", TINY + ["max_steps=2", setting], *extra)) != 0
        assert says in error_line(capsys)
        assert snapshot(trained_model) == before


def test_force_deletes_nothing_when_the_data_refuses_the_settings(trained_model, tiny_run, capsys):  # noqa: F811
    """Windows longer than every shard: refused by the data, after the settings are checked but still before
    --force deletes the old model."""
    before = snapshot(trained_model)
    capsys.readouterr()
    assert main(cli_train(tiny_run, "kept", TINY + ["max_steps=2", "seq_len=4096"], "--force")) == 1
    assert "lower seq_len" in error_line(capsys) and snapshot(trained_model) == before


def test_every_numeric_setting_has_a_range_checked_by_the_api_too(trained_model, tiny_run):  # noqa: F811
    numeric = {f.name for f in fields(TrainConfig) if f.type in ("int", "float")}
    assert numeric == set(RANGES)
    before = snapshot(trained_model)
    for wrong in ({"batch_size": 0}, {"eval_every": 0}, {"steer_layer": 2}, {"n_head": 3}, {"name": "../x"}):
        with pytest.raises(SettingError):
            train(TrainConfig(run_dir=str(tiny_run), **{"name": "kept", "max_steps": 2, **wrong}), force=True)
    assert snapshot(trained_model) == before


def test_restarts_refuse_to_delete_files_cblm_did_not_write(trained_model, tiny_run, capsys):  # noqa: F811
    """--force deletes only what the cblm commands wrote; a file of the user's in the model folder, or in the
    checkpoint folder that a resume replaces, stops the command with one line naming it, and nothing is deleted."""
    (trained_model / "notes.txt").write_text("my notes")
    before = snapshot(trained_model)
    capsys.readouterr()
    assert main(cli_train(tiny_run, "kept", TINY + ["max_steps=2"], "--force")) == 1
    assert "notes.txt" in error_line(capsys) and snapshot(trained_model) == before
    (trained_model / "notes.txt").unlink()

    config = TrainConfig.from_overrides(str(tiny_run), TINY + ["max_steps=3", "checkpoint_every=1", "name=resumed"])
    assert train(config, log=lambda m: None, stop_after=1) == {}
    folder = tiny_run / "cblm" / "resumed"
    (folder / "checkpoint" / "my-copy.pt").write_text("a copy of my own")
    before = snapshot(folder)
    with pytest.raises(ValueError, match=r"checkpoint/my-copy\.pt.*nothing was deleted"):
        train(config, log=lambda m: None)
    assert snapshot(folder) == before
    (folder / "checkpoint" / "my-copy.pt").unlink()
    assert train(config, log=lambda m: None)["step"] == 3

    (trained_model / "transducer").mkdir()
    (trained_model / "transducer" / "config.json").write_text("{}")
    assert main(cli_train(tiny_run, "kept", TINY + ["max_steps=2"], "--force")) == 0
    assert not (trained_model / "transducer").exists()  # what tda wrote went with the old model


def test_cblm_trains_only_inside_an_atlas_run(tiny_run, tmp_path, capsys):  # noqa: F811
    """Token shards in a folder that is not an Atlas run: refused with one line, and nothing is written there."""
    folder = tmp_path / "shards"
    for part in ("tokens", "library"):
        shutil.copytree(tiny_run / part, folder / part)
    before = snapshot(folder)
    assert main(cli_train(folder, "cblm", TINY + ["max_steps=1"])) == 1
    assert "not a run that Atlas made" in error_line(capsys)
    assert snapshot(folder) == before and not (folder / "cblm").exists()
