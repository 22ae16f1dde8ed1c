import json
import re
import subprocess
import sys

from conftest import write_config, write_jsonl

from atlas.cli import main


def test_help_lists_commands_and_examples():
    out = subprocess.run([sys.executable, "-m", "atlas.cli", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for word in ("run", "plan", "stage", "status", "inspect", "demo-corpus", "examples:"):
        assert word in out


def test_slurm_style_plan_then_shards_then_finalize(tmp_path, demo_records, capsys):
    config_path = write_config(tmp_path, write_jsonl(tmp_path / "docs.jsonl", demo_records[:25]))
    assert main(["plan", str(config_path), "--stages", "chunk"]) == 0
    assert "chunk: planned 3 shard(s)" in capsys.readouterr().out
    run_dir = str(tmp_path / "run")
    assert main(["stage", "chunk", "--run-dir", run_dir, "--shard", "1"]) == 0  # one array task = one shard
    assert main(["stage", "chunk", "--run-dir", run_dir, "--shard", "0", "--num-shards", "2"]) == 0  # shards 0, 2
    assert main(["stage", "chunk", "--run-dir", run_dir, "--shard", "1"]) == 0
    out = capsys.readouterr().out
    assert "chunk shard 00002: done" in out and "chunk shard 00001: already done" in out
    assert main(["status", run_dir]) == 0
    assert re.search(r"chunk +planned +3/3", capsys.readouterr().out)  # all shards done; the stage not finalized
    # finalizes: writes stats and _SUCCESS
    assert main(["run", str(config_path), "--inline", "--stages", "chunk"]) == 0
    assert "chunk: 0 shard(s) to run, 3 already done" in capsys.readouterr().out
    assert main(["status", run_dir]) == 0
    out = capsys.readouterr().out
    assert re.search(r"chunk +done", out) and "chunks_out" in out


def test_stage_before_plan_and_bad_status_dir(tmp_path, capsys):
    try:
        main(["stage", "chunk", "--run-dir", str(tmp_path), "--shard", "0"])
    except SystemExit as e:
        assert "is not planned; run `atlas plan CONFIG` first" in str(e)
    try:
        main(["status", str(tmp_path)])
    except SystemExit as e:
        assert "not an Atlas run directory" in str(e)


def test_inspect_shows_readable_rows(tmp_path, demo_records, capsys):
    config_path = write_config(tmp_path, write_jsonl(tmp_path / "docs.jsonl", demo_records[:3]))
    assert main(["run", str(config_path), "--inline", "--stages", "chunk"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "run"), "chunks", "-n", "2", "--chars", "80"]) == 0
    out = capsys.readouterr().out
    assert out.count("chunk_id=") == 2 and "n_tokens=" in out and "│ " in out and "[...]" in out
    first = [line for line in out.splitlines() if line.startswith("chunk_id=")]
    shown = []
    for _ in range(2):  # --random: rows drawn with the seed, the same ones each time
        assert main(["inspect", str(tmp_path / "run"), "chunks", "-n", "2", "--random", "4"]) == 0
        shown.append([line for line in capsys.readouterr().out.splitlines() if line.startswith("chunk_id=")])
    assert shown[0] == shown[1] and len(shown[0]) == 2
    assert main(["inspect", str(tmp_path / "run"), "chunks", "-n", "99", "--random", "4"]) == 0
    every = [line for line in capsys.readouterr().out.splitlines() if line.startswith("chunk_id=")]
    assert set(shown[0]) <= set(every) and every[:2] == first  # -n past the end: every row, in file order


def test_atlas_stage_runs_with_the_config_of_the_latest_plan(tmp_path, demo_records, capsys):
    """SLURM array tasks read the config from the manifest: re-planning with --force must update it."""
    import yaml

    config_path = write_config(tmp_path, write_jsonl(tmp_path / "docs.jsonl", demo_records[:10]))
    run_dir = str(tmp_path / "run")
    assert main(["plan", str(config_path), "--stages", "chunk"]) == 0
    data = yaml.safe_load(config_path.read_text())
    data["chunk"] = {"domains": {"web": {"max_tokens": 40}}}
    config_path.write_text(yaml.safe_dump(data))
    assert main(["plan", str(config_path), "--stages", "chunk", "--force"]) == 0
    assert main(["stage", "chunk", "--run-dir", run_dir, "--shard", "0"]) == 0
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["config"]["chunk"]["domains"]["web"]["max_tokens"] == 40


def test_prefect_logging_config_quiets_the_temporary_servers_cancelled_rollbacks(tmp_path, monkeypatch):
    """Ctrl-C also stops Prefect's temporary server (a subprocess on the same terminal), whose SQLAlchemy pool then
    logged each cancelled rollback as an ERROR traceback under Atlas's one line. The CLI points both processes at
    Prefect's logging config plus that one quiet logger."""
    import os

    from atlas.cli import _prefect_logging_config

    monkeypatch.delenv("PREFECT_LOGGING_SETTINGS_PATH", raising=False)
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    _prefect_logging_config()
    path = os.environ["PREFECT_LOGGING_SETTINGS_PATH"]
    assert path.startswith(str(tmp_path))
    check = ("import logging; from prefect.logging.configuration import setup_logging; setup_logging(); "
             "print(logging.getLogger('sqlalchemy.pool.impl.AsyncAdaptedQueuePool').isEnabledFor(logging.ERROR), "
             "logging.getLogger('prefect.flow_runs').handlers[0].__class__.__name__)")
    quiet = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=os.environ | {
        "PREFECT_LOGGING_SETTINGS_PATH": path}, check=True).stdout.split()
    default = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env={
        k: v for k, v in os.environ.items() if k != "PREFECT_LOGGING_SETTINGS_PATH"}, check=True).stdout.split()
    assert quiet == ["False", default[1]] and default[0] == "True"  # Prefect's own handlers are all still there
