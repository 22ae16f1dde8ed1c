"""Shared fixtures. Tests run offline; ../shared/data is used when present and skipped otherwise."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")  # busy CI machines start slowly

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data" / "dev"


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
    docs = write_jsonl(folder / "docs.jsonl", [dict(r, label=r["data_src"]) for r in picked])
    annotator = {"epochs": 5, "hidden": 32, "judge_sample": 5, "min_per_concept": 2}
    config = load_config(write_config(folder, docs, input={"metadata_fields": ["label"]}, library={"ks": [8, 16]},
                                      tag={"batch_size": 64}, annotator=annotator))
    run_stages(config, ["chunk", "tag", "vocab", "cluster", "coherence", "label", "library", "targets",
                        "train_annotator"], log=lambda m: None)
    return config, RunDir(config.run_dir)
