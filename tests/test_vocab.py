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
from atlas.models.embedder import Embedder, mean_pairwise_cosine
from atlas.runner import run_stages
from atlas.stages.vocab import CONTEXT_SAMPLE, context_specificity

pytestmark = pytest.mark.slow  # loads the embedding model


def test_vocabulary_counts_chunks_and_cached_embeddings(tmp_path, demo_records):
    docs = write_jsonl(tmp_path / "docs.jsonl", [r for r in demo_records if r["data_src"] == "python-docs"][:6])
    with FaultServer(mode="ok") as server:
        # the fake model's tags are words of the prompt on every chunk: generic in context, so that test is off
        vocab = {"min_count": 2, "max_chunk_share": 1.0, "min_context_specificity": 0}
        config = load_config(write_config(tmp_path, docs, **openai_sections(server), vocab=vocab))
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
        config = load_config(write_config(tmp_path, docs, **openai_sections(server), vocab={
            "max_chunk_share": 0.3, "generic_min_chunks": 2, "min_context_specificity": 0}))
        run_stages(config, ["chunk", "tag", "vocab"], log=lambda m: None)
    run = RunDir(config.run_dir)
    tagged = len({t["chunk_id"] for t in pq.read_table(run.output_dir("tags")).to_pylist()})
    rows = load_vocab(run)[0].to_pylist()
    stats = json.loads(run.stats_path("tag_vocab").read_text())["counters"]
    assert rows and all(r["n_chunks"] <= max(0.3 * tagged, 2) for r in rows)
    assert stats["dropped.generic_tags"] > 0
    dropped = stats["dropped.generic_tags"] + stats.get("dropped.rare_unknown_words", 0)
    assert dropped == stats["unique_tags"] - len(rows)


def test_context_specificity_is_measured_within_each_domain():
    rng = np.random.default_rng(0)

    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    background = {"web": 0.0, "code": 0.0}  # random directions in 64 dimensions: mean cosine about 0
    scattered = unit(rng.normal(size=(8, 64)))  # chunks with nothing in common
    u, v = unit(rng.normal(size=(2, 64)))
    alike_in_each = unit(np.concatenate([u + 0.3 * rng.normal(size=(4, 64)) / 8,
                                         v + 0.3 * rng.normal(size=(4, 64)) / 8]))
    domains = ["web"] * 4 + ["code"] * 4
    assert abs(context_specificity(scattered, ["web"] * 8, background)) < 0.2
    # one topic in two domains: alike within each, though the two halves are unrelated (pooled, it would read ~0.5)
    assert context_specificity(alike_in_each, domains, background) > 0.9
    # the baseline is the domain's: the same chunks against a domain whose random chunks are as alike score 0
    assert context_specificity(alike_in_each, domains, {"web": 0.97, "code": 0.97}) < 0.1
    assert context_specificity(alike_in_each[:6], ["web"] * 3 + ["code"] * 3, background) is None  # too few in each
    assert context_specificity(scattered, ["math"] * 8, background) is None  # no baseline for the domain


def test_tags_generic_in_context_are_left_out(tmp_path, demo_records):
    """A tag whose chunks are no more alike than the domain's is left out: the stage's sample of chunks and baseline
    agree with the measure computed here on every chunk, and 0 turns the test off."""
    # the first 6,000 characters of each page: still enough tags on 4+ chunks to test, and 43% less text to tag
    docs = write_jsonl(tmp_path / "docs.jsonl", [dict(r, text=r["text"][:6_000]) for r in demo_records
                                                 if r["data_src"] == "python-docs"][:30])
    config = load_config(write_config(tmp_path, docs, llm={"engine": "offline"}, vocab={"context_min_chunks": 4}))
    run_stages(config, ["chunk", "tag", "vocab"], log=lambda m: None)
    run = RunDir(config.run_dir)
    stats = json.loads(run.stats_path("tag_vocab").read_text())["counters"]
    kept = set(load_vocab(run)[0].column("tag_norm").to_pylist())
    roles = field_roles(load_schemas(config.tag)[0])
    chunks = defaultdict(set)
    for t in pq.read_table(run.output_dir("tags")).to_pylist():
        if roles[t["field"]] == "topic":
            chunks[t["tag_norm"]].add(t["chunk_id"])
    generic = max(config.vocab.max_chunk_share * len(set().union(*chunks.values())), config.vocab.generic_min_chunks)
    tested = {t for t, c in chunks.items() if 4 <= len(c) <= generic}
    assert stats["context_tags_tested"] == len(tested) and max(len(chunks[t]) for t in tested) <= CONTEXT_SAMPLE

    texts = {r["chunk_id"]: r for r in pq.read_table(run.output_dir("chunks")).to_pylist()}
    tagged = sorted(set().union(*chunks.values()))
    vectors = Embedder(config.annotator.encoder).encode([texts[c]["chunk_text"] for c in tagged])
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    row = {c: i for i, c in enumerate(tagged)}
    domain = {c: texts[c]["domain"] for c in tagged}
    background = {d: mean_pairwise_cosine(vectors[[row[c] for c in tagged if domain[c] == d]])
                  for d in set(domain.values())}
    scores = {t: context_specificity(vectors[[row[c] for c in sorted(chunks[t])]],
                                     [domain[c] for c in sorted(chunks[t])], background) for t in tested}
    threshold = config.vocab.min_context_specificity
    dropped = {t for t in tested if t not in kept}
    assert stats["dropped.generic_in_context"] == len(dropped) > 0 and len(dropped) < len(tested)
    clear = {t for t, s in scores.items() if abs(s - threshold) > 0.02}  # the stage samples 200 chunks of the domain
    assert {t for t in clear if scores[t] < threshold} == dropped & clear and len(clear) > 0.8 * len(tested)

    config = load_config(write_config(tmp_path, docs, llm={"engine": "offline"},
                                      vocab={"context_min_chunks": 4, "min_context_specificity": 0}))
    run_stages(config, ["vocab"], force=True, log=lambda m: None)
    assert dropped <= set(load_vocab(run)[0].column("tag_norm").to_pylist())
