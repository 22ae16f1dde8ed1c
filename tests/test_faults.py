"""Fault injection on the whole pipeline: SIGKILL in every stage, a full disk, a read-only run directory.

Each test compares against an uninterrupted run of the same config: after the faults and a rerun,
every data file must be byte-identical. Files that hold timings or resume bookkeeping (the manifest,
shard markers, merged counters, caches, the report) are left out of the comparison; they are
allowed to differ (a resumed tag stage counts cache hits, for one).
"""

import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import finish_process, wait_for, write_config, write_jsonl

from atlas.core.ownership import claim
from atlas.stages import STAGES

pytestmark = pytest.mark.slow

MAX_DELAY = 0.3  # the latest a kill lands after its stage starts (seconds)
RUN_S = 300  # the longest a whole `atlas run` of the small pipeline may take; each wait below has its own deadline
EXCLUDED_NAMES = {"manifest.json", "_stats.json"}
EXCLUDED_PARTS = {"_shards", "_cache", "report", "_staging"}
SMALL = {"library": {"ks": [8, 16]}, "tag": {"batch_size": 16},
         "annotator": {"epochs": 5, "hidden": 32, "judge_sample": 5, "min_per_concept": 2},
         "annotate": {"zarr_chunk_rows": 7, "block_rows": 5}, "tokenize": {"block_rows": 6}}


def without_timings(value):
    """A JSON value with its wall-clock fields ("seconds", "train_seconds"...) taken out."""
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if "seconds" not in k}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def data_files(run_dir: Path) -> dict[str, bytes]:
    """Every file that holds results (not timings or bookkeeping), as bytes; JSON files without their timings."""
    files = {}
    for path in sorted(run_dir.rglob("*")):
        rel = path.relative_to(run_dir)
        if (path.is_file() and path.name not in EXCLUDED_NAMES and not EXCLUDED_PARTS & set(rel.parts)
                and not path.name.endswith(".tmp")):
            data = path.read_bytes()
            if path.suffix == ".json":
                data = json.dumps(without_timings(json.loads(data)), sort_keys=True).encode()
            files[str(rel)] = data
    return files


def atlas_run(config: Path, stages: str | None = None, **popen) -> subprocess.Popen:
    command = [sys.executable, "-m", "atlas.cli", "run", str(config), "--inline", "--no-progress"]
    command += ["--stages", stages] if stages else []
    return subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **popen)


def finish(process: subprocess.Popen, what: str = "`atlas run`", timeout: float = RUN_S) -> str:
    out, err = finish_process(process, what, timeout)
    assert process.returncode == 0, err[-3000:]
    return out


def atlas_status(run_dir: Path) -> str:
    process = subprocess.Popen([sys.executable, "-m", "atlas.cli", "status", str(run_dir)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    return finish_process(process, "`atlas status`", 60)[0]


def running_stage(run_dir: Path, pid: int) -> str | None:
    """The stage that process ``pid`` is running (a killed process leaves its stage marked running: skip those)."""
    try:
        manifest = json.loads((run_dir / "manifest.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if manifest.get("driver", {}).get("pid") != pid:
        return None
    return next((name for name, info in manifest.get("stages", {}).items() if info.get("status") == "running"), None)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, demo_records):
    """A 24-document config through every stage, the data files of its uninterrupted run, and how long each of
    its stages took (wall seconds)."""
    folder = tmp_path_factory.mktemp("faults")
    sources = ("python-docs", "python-math-docs", "python-stdlib")
    # Each text cut to its first 10,000 characters: the stdlib's modules run to 20,000, and whole they were most of
    # the chunks, so most of the time of every run in this module. Cut, they still make a library of a few concepts.
    docs = write_jsonl(folder / "docs.jsonl", [dict(r, text=r["text"][:10_000]) for s in sources
                                               for r in [d for d in demo_records if d["data_src"] == s][:8]])
    # the library from a sample of the documents, as at scale: annotate, tokenize and index still see every chunk
    sections = SMALL | {"tag": SMALL["tag"] | {"sample_fraction": 0.75}}
    config = write_config(folder, docs, input={"docs_per_shard": 6}, **sections)
    finish(atlas_run(config), "the uninterrupted reference run")
    manifest = json.loads((folder / "run" / "manifest.json").read_text())
    wall = {name: info.get("wall_seconds", MAX_DELAY) for name, info in manifest["stages"].items()}
    return config, data_files(folder / "run"), wall


def with_run_dir(config: Path, run_dir: Path) -> Path:
    data = yaml.safe_load(config.read_text()) | {"run_dir": str(run_dir)}
    path = run_dir.parent / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.timeout(1500)  # 13 runs of the pipeline: 1-2 min on 2 quiet cores, far longer on a busy machine
def test_sigkill_at_random_points_of_every_stage_then_rerun_gives_identical_outputs(pipeline, tmp_path):
    """Kill `atlas run` once per stage, at a random moment after the stage starts (seeded; the seed is printed),
    restart it each time, and compare the finished run with the uninterrupted one. The moment is drawn within the
    stage's duration in the uninterrupted run (at most 0.3 s), so that quick stages are hit too; one that ends
    before the kill gets it in the stage after it."""
    config, reference, wall = pipeline
    run_dir = tmp_path / "run"
    config = with_run_dir(config, run_dir)
    seed = int(os.environ.get("ATLAS_FAULT_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    print(f"ATLAS_FAULT_SEED={seed}")
    order = {name: i for i, name in enumerate(STAGES)}
    kills: list[tuple[str, float]] = []
    # Once per stage: a second kill would land in the same first 0.3 s of the stage, and each kill costs a restart.
    for target in STAGES:
        process = atlas_run(config)
        # Wait for the target stage, or a later one when the target is already done or too quick to see.
        wait_for(lambda p=process, t=target: p.poll() is not None or order.get(running_stage(run_dir, p.pid), -1)
                 >= order[t], f"`atlas run` to start stage {target} (kills so far: {kills})", RUN_S, interval=0.005)
        if process.poll() is not None:  # the run finished: nothing left to kill
            break
        delay = rng.uniform(0, min(MAX_DELAY, 0.8 * wall.get(target, MAX_DELAY)))
        time.sleep(delay)
        stage = running_stage(run_dir, process.pid)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            kills.append((stage or "between stages", round(delay, 3)))
        finish_process(process, "the killed `atlas run` to exit", 60)
    print("kills (stage, seconds after it started):", kills)
    out = finish(atlas_run(config), "the rerun after the kills")
    assert "index" in out
    killed_in = {stage for stage, _ in kills}
    assert len(kills) >= 10 and len(killed_in & set(STAGES)) >= 10, kills
    assert data_files(run_dir) == reference

    status = atlas_status(run_dir)
    assert "interrupted" not in status and status.count(" done ") >= len(STAGES)


def test_status_says_interrupted_after_a_kill(pipeline, tmp_path):
    config, _, _ = pipeline
    run_dir = tmp_path / "run"
    config = with_run_dir(config, run_dir)
    process = atlas_run(config)
    wait_for(lambda: process.poll() is not None or running_stage(run_dir, process.pid) == "tag",
             "`atlas run` to start stage tag", 120)
    assert process.poll() is None, "`atlas run` ended before its tag stage could be killed"
    os.killpg(process.pid, signal.SIGKILL)
    finish_process(process, "the killed `atlas run` to exit", 60)
    status = atlas_status(run_dir)
    assert "tag              interrupted" in status and "rerun the same command to resume" in status


# --- a full disk and a read-only run directory ----------------------------------------------------------


def mount_namespaces() -> bool:
    """Whether this machine lets us mount a small tmpfs in a private mount namespace (root in a container)."""
    try:
        probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                                "mount -t tmpfs -o size=64k tmpfs /mnt && umount /mnt"], capture_output=True,
                               timeout=60)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def run_in_namespace(script: str, config: Path, stages: str) -> subprocess.CompletedProcess:
    """Run ``script`` (which mounts something) then `atlas run` in a private mount namespace."""
    command = f"{script} && exec {sys.executable} -m atlas.cli run {config} --inline --no-progress --stages {stages}"
    process = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", command],
                               start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = finish_process(process, f"`atlas run --stages {stages}` in a private mount namespace", RUN_S)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def limit_file_size(limit: int):
    def apply():  # writes past `limit` bytes fail with EFBIG instead of killing the process
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_full_disk_gives_a_clear_error_and_the_rerun_completes(pipeline, tmp_path):
    config, reference, _ = pipeline
    run_dir = tmp_path / "run"
    # The reference run's caches (tag answers, embeddings): computing the stages before annotate again, where the
    # disk fills, took most of this test's time. Annotate reads no cache: it computes what it writes.
    claim(run_dir, "run", "run directory")  # the folder is the run's before its caches are copied in
    shutil.copytree(config.parent / "run" / "_cache", run_dir / "_cache")
    config = with_run_dir(config, run_dir)
    finish(atlas_run(config, "chunk,tag"), "`atlas run --stages chunk,tag`")
    before = data_files(run_dir)
    later = "vocab,cluster,coherence,label,library,targets,train_annotator,annotate,tokenize,index"
    if mount_namespaces():
        # A real full disk: an 8 KiB tmpfs over the folder of the annotate stage's parts. What the failed
        # stage wrote there goes with the namespace, as it would be lost on a full disk.
        (run_dir / "annotated").mkdir()
        done = run_in_namespace(f"mount -t tmpfs -o size=8k tmpfs {run_dir / 'annotated'}", config, later)
        expected = "No space left on device"
    else:  # no mount rights: any file past 16 KiB fails to write (EFBIG), like a full disk for big files
        process = atlas_run(config, later, preexec_fn=limit_file_size(16 << 10))
        out, err = finish_process(process, "`atlas run` with a 16 KiB file size limit", RUN_S)
        done = subprocess.CompletedProcess(process.args, process.returncode, out, err)
        expected = "File too large"
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert expected in done.stderr and "error:" in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    after = data_files(run_dir)
    assert {k: v for k, v in after.items() if k in before} == before  # finished stages untouched
    assert not [p for p in run_dir.rglob("*.tmp")], "a half-written file was left behind"
    finish(atlas_run(config), "the rerun after the full disk")
    assert data_files(run_dir) == reference


def test_a_read_only_run_directory_gives_a_clear_error_and_changes_nothing(pipeline, tmp_path):
    config, reference, _ = pipeline
    run_dir = tmp_path / "run"
    config = with_run_dir(config, run_dir)
    finish(atlas_run(config, "chunk"), "`atlas run --stages chunk`")
    before = {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    if mount_namespaces():
        done = run_in_namespace(f"mount --bind {run_dir} {run_dir} && mount -o remount,bind,ro {run_dir}", config,
                                "chunk,tag")
    elif os.geteuid() != 0:
        for path in [run_dir, *run_dir.rglob("*")]:
            path.chmod(path.stat().st_mode & ~0o222)
        process = atlas_run(config, "chunk,tag")
        out, err = finish_process(process, "`atlas run` on a read-only run directory", RUN_S)
        done = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    else:
        pytest.skip("root without mount rights: a read-only directory cannot be made here")
    assert done.returncode == 1 and "error:" in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "Read-only file system" in done.stderr or "Permission denied" in done.stderr
    after = {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert after == before


# --- an LLM endpoint that fails 30% of the time -----------------------------------------------------------


def test_llm_endpoint_faults_at_30_percent_the_library_completes_and_accounts_for_everything(tmp_path, demo_records):
    """Tagging, coherence judging, labeling and auxiliary labels all go through the `openai` engine against a
    loopback server that spoils 30% of its answers (bad JSON, cut short, off-schema, HTTP 500/429, stalls)."""
    from fault_server import FaultServer
    from test_tag_stage import accounted

    from atlas.config import load_config
    from atlas.core.rundir import RunDir
    from atlas.runner import run_stages

    docs = write_jsonl(tmp_path / "docs.jsonl", [r for r in demo_records if r["data_src"] == "python-docs"][:10])
    with FaultServer(mode="mixed", fault_rate=0.3, seed=7, hang_s=1.5) as server:
        llm = {"engine": "openai", "base_url": server.base_url, "model": "m", "timeout_s": 1.0, "max_retries": 2,
               "backoff_s": 0.01, "max_concurrency": 8}
        # the fake model gives every chunk tags from a dozen words: none may be called generic or incoherent here
        config = load_config(write_config(tmp_path, docs, llm=llm,
                                          vocab={"max_chunk_share": 1.0, "min_context_specificity": 0},
                                          library=SMALL["library"] | {"min_chunk_cohesion": 0,
                                                                      "min_cross_tag_cohesion": 0},
                                          **{k: SMALL[k] for k in ("tag", "annotator")}))
        run_stages(config, ["chunk", "tag", "vocab", "cluster", "coherence", "label", "library", "targets"],
                   log=lambda m: None)
    faults = len(server.served) - server.served.count("ok")
    assert 0.2 < faults / len(server.served) < 0.4 and len(server.served) > 100
    run = RunDir(config.run_dir)
    n_chunks, n_tagged, n_quarantined = accounted(run)  # every chunk: tagged or quarantined with its reason
    assert n_tagged > 0.8 * n_chunks
    counters = {name: json.loads(run.stats_path(STAGES[name].output).read_text())["counters"] for name in STAGES
                if run.stats_path(STAGES[name].output).exists()}
    coherence = counters["coherence"]  # every cluster kept, or dropped with its reason (judge_failed among them)
    kept = coherence.get("clusters_kept", 0)
    assert kept + sum(v for k, v in coherence.items() if k.startswith("dropped.")) == coherence["clusters_in"] > 0
    assert counters["label"].get("concepts_out", 0) == kept
    assert counters["targets"]["reservoir"] > 0
