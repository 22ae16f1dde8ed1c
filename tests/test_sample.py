"""The paper's two paths: a library from a sample of the documents, annotation of every chunk; an annotator reused
by another run; each distinct text sent to the engine once."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import zarr
from conftest import copy_run_dir, write_config, write_jsonl
from fault_server import FaultServer
from test_tag_stage import openai_sections

from atlas.config import ConfigError, load_config
from atlas.core.files import ArtifactError
from atlas.core.rundir import RunDir
from atlas.io.chunks import sample_position
from atlas.runner import run_stages
from atlas.stages import LIBRARY_STAGES
from atlas.tools.report import write_html_report
from atlas.tools.status import format_status

TAGGING = ["chunk", "tag"]


def tagged_docs(run: RunDir) -> set[str]:
    chunk_ids = set(pq.read_table(run.output_dir("tags"), columns=["chunk_id"]).column(0).to_pylist())
    chunks = pq.read_table(run.output_dir("chunks"), columns=["chunk_id", "doc_id"]).to_pylist()
    return {c["doc_id"] for c in chunks if c["chunk_id"] in chunk_ids}


def counters(run: RunDir, output: str) -> dict:
    return json.loads(run.stats_path(output).read_text())["counters"]


@pytest.mark.slow
def test_the_sample_is_the_same_documents_however_the_input_is_sharded(tmp_path, demo_records):
    # Each text cut to its first 2,000 characters: which documents are sampled does not depend on their length, and
    # whole, the standard-library modules among them were most of the chunks to tag, three times over.
    docs = write_jsonl(tmp_path / "docs.jsonl", [dict(r, text=r["text"][:2_000]) for r in demo_records[:40]])
    runs = []
    for docs_per_shard in (3, 40):
        folder = tmp_path / f"shards-{docs_per_shard}"
        folder.mkdir()
        config = load_config(write_config(folder, docs, input={"docs_per_shard": docs_per_shard},
                                          tag={"batch_size": 64, "sample_fraction": 0.4}))
        run_stages(config, TAGGING, log=lambda m: None)
        runs.append(RunDir(config.run_dir))
    sampled = tagged_docs(runs[0])
    expected = {r["id"] for r in demo_records[:40] if sample_position(r["id"]) < 0.4}
    assert sampled == tagged_docs(runs[1]) == expected  # a chunk-less document would be absent from both
    assert 8 <= len(sampled) <= 24  # about 40% of 40
    stats = counters(runs[0], "tags")
    assert stats["docs_in"] == 40 and stats["docs_sampled"] == len(sampled)
    assert stats["chunks_tagged"] + stats.get("chunks_quarantined", 0) == stats["chunks_sampled"] < stats["chunks_in"]
    assert (f"library sample (tag.sample_fraction 0.4): {len(sampled)} of 40 documents, {stats['chunks_sampled']} of "
            f"{stats['chunks_in']} chunks tagged") in format_status(runs[0])
    report = write_html_report(runs[0].root).read_text()
    assert f"library sample (tag.sample_fraction 0.4): {len(sampled)} of 40" in report

    # sample_max_docs keeps the documents with the lowest positions
    folder = tmp_path / "capped"
    folder.mkdir()
    config = load_config(write_config(folder, docs, input={"docs_per_shard": 7},
                                      tag={"batch_size": 64, "sample_fraction": 0.4, "sample_max_docs": 5}))
    run_stages(config, TAGGING, log=lambda m: None)
    lowest = sorted(expected, key=sample_position)[:5]
    assert tagged_docs(RunDir(config.run_dir)) == set(lowest)


def test_chunks_with_the_same_text_are_one_engine_request(tmp_path, demo_records):
    text = demo_records[0]["text"][:400]
    variant = "  " + text.replace(" ", "\n ", 3) + "\n"  # the same words, other whitespace
    records = [{"id": "a", "text": text}, {"id": "b", "text": variant}, {"id": "c", "text": text},
               {"id": "d", "text": demo_records[1]["text"][:400]}]
    docs = write_jsonl(tmp_path / "docs.jsonl", records)
    with FaultServer(mode="ok") as server:
        config = load_config(write_config(tmp_path, docs, **openai_sections(server)))
        run_stages(config, TAGGING, log=lambda m: None)
        asked = len(server.requests)
    run = RunDir(config.run_dir)
    assert asked == 2
    stats = counters(run, "tags")
    assert stats["duplicate_texts"] == 2 and stats["chunks_tagged"] == 4 and stats["requests"] == 2
    rows = pq.read_table(run.output_dir("tags")).to_pylist()
    tags = {doc: [(r["field"], r["tag_norm"]) for r in rows if r["chunk_id"].startswith(f"{doc}:")] for doc in "abcd"}
    assert tags["a"] == tags["b"] == tags["c"] and tags["a"]


@pytest.mark.slow
def test_an_annotator_from_another_run_annotates_as_it_would_there(annotated_run, tmp_path):
    """The trained fixture run annotates its own chunks (the annotated_run fixture); a second run with
    annotate.annotator_from pointing at it chunks the same input, runs no library stage, and writes the same
    annotated bytes and embeddings."""
    run_copy = copy_run_dir(annotated_run[1].root, tmp_path / "run")  # a private copy: its library is changed below
    source_config = json.loads((run_copy / "manifest.json").read_text())["config"]

    folder = tmp_path / "second"
    folder.mkdir()
    sections = {k: source_config[k] for k in ("chunk", "annotate", "tokenize")}
    sections["annotate"] = dict(sections["annotate"], annotator_from=str(run_copy))
    inputs = dict(source_config["input"])
    config_path = write_config(folder, inputs.pop("path"), input=inputs, **sections)
    config = load_config(config_path)
    reports = run_stages(config, log=lambda m: None)
    assert [r.name for r in reports] == ["chunk", "annotate", "tokenize", "index"]
    second = RunDir(config.run_dir)
    assert not second.output_dir("tags").exists()
    for output in ("chunks", "annotated", "tokens"):
        parts = sorted((run_copy / output).glob("part-*.parquet"))
        assert parts
        for part in parts:
            assert part.read_bytes() == (second.root / output / part.name).read_bytes(), part
    source = json.loads((second.output_dir("annotator") / "_source.json").read_text())
    trained_on = json.loads((run_copy / "annotator" / "config.json").read_text())["library_sha256"]
    assert source["library_sha256"] == trained_on and source["annotator_from"] == str(run_copy)
    ours, theirs = zarr.open_group(second.root / "embeddings.zarr"), zarr.open_group(run_copy / "embeddings.zarr")
    assert np.array_equal(ours["embeddings"][:], theirs["embeddings"][:])

    status = format_status(second)
    assert f"annotator and library from {run_copy}" in status
    assert all(f"{name:<16} not in this run" in status for name in LIBRARY_STAGES)

    with pytest.raises(ConfigError, match="annotator_from"):
        run_stages(config, ["tag"], log=lambda m: None)
    # a changed library is refused: it is not the file the annotator was trained on
    table = pq.read_table(run_copy / "library" / "concepts.parquet")
    pq.write_table(table, run_copy / "library" / "concepts.parquet", compression="gzip")
    with pytest.raises(ArtifactError, match="not the library this annotator was trained on"):
        run_stages(load_config(config_path), ["annotate"], force=True, log=lambda m: None)
