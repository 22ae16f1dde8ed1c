"""infra/slurm at real sizes: arrays that fit MaxArraySize, aftercorr between map stages, strided shards.

`sbatch` and `scontrol` are stubs that record their arguments (there is no SLURM here); `atlas plan` and
`atlas stage` are the real commands.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, write_config, write_jsonl

from atlas.core.rundir import RunDir
from atlas.io import layout

SBATCH = """#!/bin/bash
# Records its arguments, answers like `sbatch --parsable`: a new job id.
echo "$*" >> "$STUB_LOG"
n=$(( $(wc -l < "$STUB_LOG") ))
echo "$((1000 + n));cluster"
"""
SCONTROL = """#!/bin/bash
echo "MaxArraySize            = ${STUB_MAX_ARRAY:-1001}"
"""


@pytest.fixture()
def planned(tmp_path, demo_records):
    """A config whose input cuts into 5 shards, and a PATH whose sbatch and scontrol are stubs."""
    config = write_config(tmp_path, write_jsonl(tmp_path / "docs.jsonl", demo_records[:10]),
                          input={"docs_per_shard": 2})
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for name, text in (("sbatch", SBATCH), ("scontrol", SCONTROL)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{stubs}:{Path(sys.executable).parent}:{os.environ['PATH']}",
               STUB_LOG=str(tmp_path / "sbatch.log"))
    return config, env, tmp_path


def submit(config, env, cwd, **extra) -> list[str]:
    done = subprocess.run(["bash", str(REPO / "infra/slurm/submit_pipeline.sh"), str(config)], cwd=cwd,
                          env=dict(env, **extra), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return (cwd / "sbatch.log").read_text().splitlines()


def job(lines: list[str], template: str) -> tuple[int, str]:
    """(job id the stub gave, the sbatch arguments) of the job that runs ``template``."""
    [(i, line)] = [(i, line) for i, line in enumerate(lines) if template in line]
    return 1001 + i, line


def test_arrays_are_split_to_fit_max_array_size_and_map_stages_chain_task_by_task(planned):
    config, env, tmp = planned
    lines = submit(config, env, tmp, STUB_MAX_ARRAY="3")  # 5 shards, arrays of at most 3 tasks
    run_dir = str(tmp / "run")
    chunk_id, chunk = job(lines, "chunk_array.sbatch")
    _, tag = job(lines, "tag_array.sbatch")
    annotate_id, annotate = job(lines, "annotate_array.sbatch")
    _, tokenize = job(lines, "tokenize_array.sbatch")
    for line in (chunk, tag, annotate, tokenize):
        assert "--array=0-2%" in line and line.endswith(f"{run_dir} 3")  # 3 tasks, each told the stride
    assert "--dependency" not in chunk
    assert f"--dependency=aftercorr:{chunk_id}" in tag
    assert f"--dependency=aftercorr:{annotate_id}" in tokenize
    stage_jobs = [line for line in lines if "stages.sbatch" in line]
    assert len(stage_jobs) == 8 and all("--dependency=afterok:" in line for line in stage_jobs)
    assert "--dependency=afterok:" in annotate  # after the job that plans it


def test_one_task_per_shard_when_the_array_fits(planned):
    config, env, tmp = planned
    lines = submit(config, env, tmp)  # scontrol says 1001
    _, chunk = job(lines, "chunk_array.sbatch")
    assert "--array=0-4%" in chunk and chunk.endswith(str(tmp / "run"))  # no stride argument


def test_a_strided_task_runs_its_shards(planned):
    config, env, tmp = planned
    subprocess.run([sys.executable, "-m", "atlas.cli", "plan", str(config), "--stages", "chunk"], check=True,
                   capture_output=True, env=env, timeout=120)
    run = RunDir(tmp / "run")
    done = subprocess.run(["bash", str(REPO / "infra/slurm/chunk_array.sbatch"), str(run.root), "3"],
                          env=dict(env, SLURM_ARRAY_TASK_ID="1"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    hash_ = run.read_manifest()["stages"]["chunk"]["hash"]
    assert [s for s in range(5) if run.is_shard_done(layout.CHUNKS, s, hash_)] == [1, 4]
