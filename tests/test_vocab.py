"""The tag vocabulary and its cached FP16 embeddings."""

import json
from collections import Counter, defaultdict

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import write_config, write_jsonl
from fault_server import FaultServer
from test_run import outputs
from test_tag_stage import openai_sections

from atlas.config import load_config
from atlas.core.rundir import RunDir
from atlas.io.tags import load_vocab
from atlas.llm.answers import field_roles, load_schemas
from atlas.runner import run_stages

pytestmark = pytest.mark.slow  # loads the embedding model


def test_vocabulary_counts_chunks_and_cached_embeddings(tmp_path, demo_records):
    docs = write_jsonl(tmp_path / "docs.jsonl", [r for r in demo_records if r["data_src"] == "python-docs"][:6])
    with FaultServer(mode="ok") as server:
        config = load_config(write_config(tmp_path, docs, **openai_sections(server),
                                          vocab={"min_count": 2, "max_chunk_share": 1.0}))
        run_stages(config, ["chunk", "tag", "vocab"], log=lambda m: None)
    run = RunDir(config.run_dir)
    all_tags = pq.read_table(run.output_dir("tags")).to_pylist()
    roles = field_roles(load_schemas(config.tag)[0])
    tags = [t for t in all_tags if roles[t["field"]] == "topic"]  # style fields never become content concepts
    assert len(tags) < len(all_tags)
    counts = Counter(t["tag_norm"] for t in tags)
    chunks = defaultdict(set)
    for t in tags:
        chunks[t["tag_norm"]].add(t["chunk_id"])

    table, vectors = load_vocab(run)
    rows = table.to_pylist()
    assert [r["tag_norm"] for r in rows] == sorted((t for t in counts if counts[t] >= 2),
                                                   key=lambda t: (-counts[t], t))
    for r in rows:
        assert r["count"] == counts[r["tag_norm"]] and r["chunk_ids"] == sorted(chunks[r["tag_norm"]])
        assert r["n_chunks"] == len(r["chunk_ids"]) and r["fields"] and r["variants"]
    stats = json.loads(run.stats_path("tag_vocab").read_text())["counters"]
    assert stats["unique_tags"] == len(counts) and stats["dropped.below_min_count"] == len(counts) - len(rows)
    assert stats["dropped.style_field_tags"] == len(all_tags) - len(tags)
    assert all(roles[f] == "topic" for r in rows for f in r["fields"])
    assert vectors.dtype == np.float16 and vectors.shape == (len(rows), 384)
    assert np.allclose(np.linalg.norm(vectors.astype(np.float32), axis=1), 1.0, atol=1e-2)
    assert stats["tags_embedded"] == len(rows)

    before = outputs(run.root) | {"_embeddings.npy": (run.output_dir("tag_vocab") / "_embeddings.npy").read_bytes()}
    run_stages(config, ["vocab"], force=True, log=lambda m: None)  # everything comes from the cache
    stats = json.loads(run.stats_path("tag_vocab").read_text())["counters"]
    assert stats["tags_from_cache"] == len(rows) and "tags_embedded" not in stats
    after = outputs(run.root) | {"_embeddings.npy": (run.output_dir("tag_vocab") / "_embeddings.npy").read_bytes()}
    assert after == before


def test_generic_tags_are_left_out_by_document_frequency(tmp_path, demo_records):
    docs = write_jsonl(tmp_path / "docs.jsonl", [r for r in demo_records if r["data_src"] == "python-docs"][:6])
    with FaultServer(mode="ok") as server:
        config = load_config(write_config(tmp_path, docs, **openai_sections(server), vocab={"max_chunk_share": 0.3,
                                                                                    "generic_min_chunks": 2}))
        run_stages(config, ["chunk", "tag", "vocab"], log=lambda m: None)
    run = RunDir(config.run_dir)
    tagged = len({t["chunk_id"] for t in pq.read_table(run.output_dir("tags")).to_pylist()})
    rows = load_vocab(run)[0].to_pylist()
    stats = json.loads(run.stats_path("tag_vocab").read_text())["counters"]
    assert rows and all(r["n_chunks"] <= max(0.3 * tagged, 2) for r in rows)
    assert stats["dropped.generic_tags"] > 0
    dropped = stats["dropped.generic_tags"] + stats.get("dropped.rare_unknown_words", 0)
    assert dropped == stats["unique_tags"] - len(rows)
