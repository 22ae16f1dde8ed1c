"""The tag stage end to end: offline engine, an OpenAI-compatible server with faults, resume from the cache."""

import json
import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
from conftest import write_config, write_jsonl
from fault_server import FaultServer
from test_run import outputs

from atlas.cli import main
from atlas.config import load_config
from atlas.core.rundir import RunDir
from atlas.io.tags import TAG_SCHEMA
from atlas.runner import run_stages
from atlas.stages.tag import QUARANTINE_SCHEMA, text_key

TAGGING = ["chunk", "tag"]  # these tests stop after tagging; the library has its own tests


def openai_sections(server, tag: dict | None = None, **llm_extra) -> dict:
    """Config sections for the openai engine against a FaultServer (fast timeouts and backoff)."""
    llm = {"engine": "openai", "base_url": server.base_url, "model": "test-model", "timeout_s": 1.0,
           "max_retries": 2, "backoff_s": 0.01, "max_concurrency": 4} | llm_extra
    return {"llm": llm, "tag": {"batch_size": 8} | (tag or {})}


def accounted(run: RunDir) -> tuple[int, int, int]:
    """(chunks, chunks with tags, chunks quarantined), read from the files themselves."""
    chunks = pq.read_table(run.output_dir("chunks"), columns=["chunk_id"]).column(0).to_pylist()
    tagged = set(pq.read_table(run.output_dir("tags"), columns=["chunk_id"]).column(0).to_pylist())
    rejects = run.output_dir("tags") / "_rejects"
    quarantined = pq.read_table(rejects).column("chunk_id").to_pylist() if rejects.exists() else []
    assert not tagged & set(quarantined)
    assert tagged | set(quarantined) == set(chunks)
    return len(chunks), len(tagged), len(quarantined)


@pytest.fixture()
def docs(tmp_path, demo_records):
    picked = [r for r in demo_records if r["data_src"] != "python-stdlib"][:8] + \
             [r for r in demo_records if r["data_src"] == "python-stdlib"][:1]
    return write_jsonl(tmp_path / "docs.jsonl", picked)


@pytest.mark.slow
def test_offline_engine_tags_every_chunk_deterministically(tmp_path, docs, capsys):
    config = load_config(write_config(tmp_path, docs, tag={"batch_size": 16}))
    run_stages(config, TAGGING, log=lambda m: None)
    run = RunDir(config.run_dir)
    table = pq.read_table(run.output_dir("tags"))
    assert table.schema.equals(TAG_SCHEMA)
    n_chunks, n_tagged, n_quarantined = accounted(run)
    assert n_tagged >= n_chunks - 2
    stats = json.loads(run.stats_path("tags").read_text())["counters"]
    assert stats["chunks_in"] == n_chunks == stats["chunks_tagged"] + stats["chunks_quarantined"]
    rows = table.to_pylist()
    code_fields = {r["field"] for r in rows if "python-stdlib" in r["chunk_id"]}
    # the topic field always; a fixed-list (style) field only where an entry clearly applies; the modules it imports
    fields = {"language", "design_pattern", "algorithm", "libraries", "role", "documentation"}
    assert {"algorithm", "libraries"} <= code_fields <= fields
    assert {r["tag_norm"] for r in rows if r["field"] == "language" and "python-stdlib" in r["chunk_id"]} <= {"python"}
    assert 4 <= len(rows) / n_tagged <= 16  # paper: 10-15 tags per chunk; offline, style fields are often empty

    again = tmp_path / "again"
    again.mkdir()
    run_stages(load_config(write_config(again, docs, tag={"batch_size": 16})), TAGGING, log=lambda m: None)
    assert outputs(again / "run") == outputs(tmp_path / "run")
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "run"), "tags", "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert "chunk_id=" in out and "main:" in out

    assert main(["judge", str(tmp_path / "run"), "--sample", "6"]) == 0
    summary = json.loads((tmp_path / "run" / "report" / "tag_relevance.json").read_text())
    assert summary["is_proxy"] and "PROXY" in summary["judge"] and summary["chunks_judged"] == 6
    assert (tmp_path / "run" / "report" / "tag_relevance_per_chunk.png").read_bytes()[:4] == b"\x89PNG"


def test_openai_engine_with_30_percent_faults_accounts_for_every_chunk(tmp_path, docs):
    with FaultServer(mode="mixed", fault_rate=0.3, seed=3, hang_s=3.0) as server:
        config = load_config(write_config(tmp_path, docs, **openai_sections(server)))
        run_stages(config, TAGGING, log=lambda m: None)
        served = list(server.served)
    run = RunDir(config.run_dir)
    n_chunks, n_tagged, n_quarantined = accounted(run)
    assert n_chunks > 30 and n_tagged > 0.8 * n_chunks
    assert sum(s != "ok" for s in served) > 0.2 * len(served)  # the faults really happened
    stats = json.loads(run.stats_path("tags").read_text())["counters"]
    assert stats["chunks_tagged"] + stats["chunks_quarantined"] == n_chunks
    assert stats["requests_retried"] > 0 and stats["tokens_in"] > 0
    assert any(k.startswith("answer_problems.") for k in stats) and stats.get("repaired.dropped_extra_fields", 0) > 0


def test_persistent_faults_are_quarantined_with_reason_and_raw_answer(tmp_path, docs):
    """One attempt per chunk (max_attempts 1), so every bad answer is quarantined; HTTP 500s are sticky."""
    with FaultServer(mode="mixed", fault_rate=0.5, seed=5, sticky=True,
                     faults=("invalid_json", "truncated", "missing_field", "http_500")) as server:
        tag = {"max_attempts": 1, "max_failed_share": 1}  # half the answers fail here: the shards must not
        config = load_config(write_config(tmp_path, docs, **openai_sections(server, tag=tag)))
        run_stages(config, TAGGING, log=lambda m: None)
    run = RunDir(config.run_dir)
    n_chunks, n_tagged, n_quarantined = accounted(run)
    assert n_quarantined > 0.2 * n_chunks
    rejects = pq.read_table(run.output_dir("tags") / "_rejects")
    assert rejects.schema.equals(QUARANTINE_SCHEMA)
    rows = rejects.to_pylist()
    assert {r["reason"] for r in rows} <= {"invalid_json", "truncated", "missing_field", "engine_error"}
    assert {r["reason"] for r in rows} >= {"invalid_json", "engine_error"}
    assert all(r["attempts"] == 1 for r in rows)
    assert all(r["raw"] for r in rows if r["reason"] != "engine_error")
    stats = json.loads(run.stats_path("tags").read_text())["counters"]
    assert sum(v for k, v in stats.items() if k.startswith("dropped.")) == n_quarantined


def test_a_code_files_extension_sets_its_language_whatever_the_engine_said(tmp_path, demo_records):
    """The server answers every field with words of the prompt; a code document whose id ends in ".py" gets
    "python" as its language, one whose id has no extension keeps the server's words."""
    code = [r for r in demo_records if r["data_src"] == "python-stdlib"][:2]
    picked = [dict(code[0], id=code[0]["id"] + ".py", text=code[0]["text"][:3000]),
              dict(code[1], text=code[1]["text"][:3000])]
    with FaultServer(mode="ok") as server:
        config = load_config(write_config(tmp_path, write_jsonl(tmp_path / "code.jsonl", picked),
                                          **openai_sections(server)))
        run_stages(config, TAGGING, log=lambda m: None)
    run = RunDir(config.run_dir)
    rows = pq.read_table(run.output_dir("tags")).to_pylist()
    language = {}
    for r in rows:
        if r["field"] == "language":
            language.setdefault(r["chunk_id"].rsplit(":", 1)[0], set()).add(r["tag_norm"])
    assert language[picked[0]["id"]] == {"python"}
    assert language[picked[1]["id"]] and "python" not in language[picked[1]["id"]]
    n_chunks = sum(1 for r in pq.read_table(run.output_dir("chunks"), columns=["doc_id"]).to_pylist()
                   if r["doc_id"] == picked[0]["id"])
    stats = json.loads(run.stats_path("tags").read_text())["counters"]
    assert stats["tags_from_file_extension"] == stats["engine_tags_replaced_by_file_extension"] == n_chunks


def test_api_key_never_reaches_the_run_directory(tmp_path, docs, monkeypatch):
    monkeypatch.setenv("ATLAS_TEST_KEY", "sk-very-secret-123")
    with FaultServer(mode="ok") as server:
        config = load_config(write_config(tmp_path, docs, **openai_sections(server, api_key_env="ATLAS_TEST_KEY")))
        run_stages(config, TAGGING, log=lambda m: None)
        assert server.headers[0]["authorization"] == "Bearer sk-very-secret-123"
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file():
            assert b"sk-very-secret" not in path.read_bytes(), path


@pytest.mark.slow
def test_killed_tagging_resumes_from_the_cache_without_asking_again(tmp_path, docs):
    """SIGKILL `atlas run` while it tags; the rerun asks the server only for what was not cached."""
    with FaultServer(mode="slow", slow_s=0.15) as server:
        sections = openai_sections(server, tag={"batch_size": 2}, max_concurrency=1)
        config_path = write_config(tmp_path, docs, **sections, execution={"progress": False})
        command = [sys.executable, "-m", "atlas.cli", "run", str(config_path), "--inline", "--stages", "chunk,tag"]
        process = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline and len(server.requests) < 12:
            time.sleep(0.02)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        asked_before_kill = len(server.requests)
        assert not (tmp_path / "run" / "tags" / "_SUCCESS").exists()
        rerun = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert rerun.returncode == 0, rerun.stderr
        total_asked = len(server.requests)
    run = RunDir(tmp_path / "run")
    n_chunks, n_tagged, _ = accounted(run)
    assert n_tagged == n_chunks
    # Each distinct text was asked once, except at most the requests in flight when the process died.
    chunks = pq.read_table(run.output_dir("chunks"), columns=["domain", "chunk_text"]).to_pylist()
    distinct = len({text_key(c) for c in chunks})
    assert distinct <= total_asked <= distinct + 2
    assert asked_before_kill >= 12
    stats = json.loads(run.stats_path("tags").read_text())["counters"]
    assert stats["cache_hits"] >= asked_before_kill - 2

    reference = tmp_path / "reference"
    reference.mkdir()
    with FaultServer(mode="ok") as server:
        run_stages(load_config(write_config(reference, docs, **openai_sections(server, tag={"batch_size": 2}))),
                   TAGGING, log=lambda m: None)
    assert outputs(reference / "run") == outputs(tmp_path / "run")


def test_llm_relevance_judge_uses_the_papers_prompt(tmp_path, docs):
    from atlas.tools.judge import judge_tags

    with FaultServer(mode="ok") as server:
        config = load_config(write_config(tmp_path, docs, **openai_sections(server)))
        run_stages(config, TAGGING, log=lambda m: None)
        asked = len(server.requests)
        summary = judge_tags(config, sample=5)
        judge_requests = server.requests[asked:]
    assert not summary["is_proxy"] and summary["chunks_judged"] == 5 and summary["pairs"] >= 5
    assert sum(summary["score_counts"].values()) == summary["pairs"]
    first = judge_requests[0]["messages"]
    assert "expert at evaluating whether concepts are genuinely present" in first[0]["content"]
    assert "=== CONCEPTS TO EVALUATE ===" in first[1]["content"] and "A. " in first[1]["content"]
