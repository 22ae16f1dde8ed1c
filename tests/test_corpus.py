"""Corpus processing: annotate (Parquet + embeddings.zarr), tokenize (token shards), resume after a kill."""

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow.dataset as ds
import pytest
import yaml
from conftest import SMALL

from atlas.config import load_config
from atlas.core.rundir import RunDir
from atlas.io.embedding_store import open_embeddings, owned_rows
from atlas.io.tokens import TokenShards
from atlas.models.annotator import Annotator
from atlas.models.tokenizer import BOS, ENDOFTEXT, EOC, cl100k
from atlas.runner import run_stages
from atlas.stages.tokenize import chunk_stream


def copy_run(trained, folder, **sections):
    """A copy of the trained run (or another fixture's run) with its own config file (sections override the config)."""
    config, run = trained
    shutil.copytree(run.root, folder / "run")
    data = config.model_dump() | {"run_dir": str(folder / "run")}
    for key, value in sections.items():
        data[key] = {**data[key], **value}
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, load_config(path)


def corpus_outputs(run_root):
    """Every byte the corpus stages produce, and the store's arrays."""
    files = {str(p.relative_to(run_root)): p.read_bytes()
             for folder in ("annotated", "tokens") for p in sorted((run_root / folder).rglob("*"))
             if p.is_file() and "_shards" not in p.parts and p.name not in ("_SUCCESS", "_stats.json")}
    store = open_embeddings(run_root)
    arrays = {name: store[name][:] for name in ("embeddings", "chunk_id", "doc_id", "source_doc_id", "data_src")}
    return files, arrays


@pytest.fixture(scope="module")
def corpus(annotated_run, tmp_path_factory):
    """The trained run annotated and tokenized with SMALL: a copy of the session's, which this module indexes."""
    path, config = copy_run(annotated_run, tmp_path_factory.mktemp("corpus"))
    return path, config, RunDir(config.run_dir)


@pytest.mark.slow
def test_annotated_row_i_is_embedding_i(corpus):
    _, config, run = corpus
    annotated = ds.dataset(sorted(str(p) for p in run.output_dir("annotated").glob("part-*.parquet")),
                           format="parquet").to_table().to_pydict()
    store = open_embeddings(run.root)
    n = len(annotated["chunk_id"])
    assert len(list(run.output_dir("annotated").glob("part-*.parquet"))) >= 3 and n > 3 * 7
    assert store["embeddings"].shape == (n, 384) and store["embeddings"].dtype == np.float16
    for name in ("chunk_id", "doc_id", "source_doc_id", "data_src"):
        assert store[name][:].tolist() == annotated[name]
    annotator = Annotator(run.output_dir("annotator")).setup()
    sample = [0, 6, 7, n // 2, n - 1]  # storage-chunk edges and the short last chunk
    fresh = annotator.embedder.encode([annotated["text"][i] for i in sample])
    np.testing.assert_allclose(store["embeddings"][sample].astype(np.float32), fresh, atol=2e-3)
    vectors = store["embeddings"][:].astype(np.float32)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-2)
    decided = annotator.decide(annotator.probabilities(vectors[sample]))
    for i, row in zip(sample, decided):
        assert annotated["concepts"][i] == [g for d in annotator.spec.domains for g, _ in row[d]]
        assert annotated["content_global_ids"][i] == [g for g, _ in row["content"]]
        assert len(annotated["concept_scores"][i]) == len(annotated["concepts"][i])


@pytest.mark.slow
def test_token_layout_and_windows(corpus):
    _, config, run = corpus
    encoding = cl100k()
    shards = TokenShards(run.root)
    texts = dict(zip(*ds.dataset(run.output_dir("annotated"), format="parquet").to_table(
        columns=["chunk_id", "text"]).to_pydict().values()))
    documents = 0
    for shard in range(len(shards.parts)):
        stream, index = shards.stream(shard), shards.index(shard)
        assert stream.dtype == np.dtype("<u4") and index["token_start"][0] == 0
        assert index["token_end"][-1] == len(stream)
        for i, (start, end, last) in enumerate(zip(index["token_start"], index["token_end"], index["doc_end_flag"])):
            tokens = stream[start:end].tolist()
            assert tokens[0] == BOS and (tokens[-1] == ENDOFTEXT) == last
            assert tokens[-2 if last else -1] == EOC
            assert encoding.decode(tokens[1 : -2 if last else -1]) == texts[index["chunk_id"][i]]  # round trip
            assert index["n_tokens"][i] == end - start - 2 - last
            if i + 1 < len(index["token_start"]):
                assert index["token_start"][i + 1] == end
        documents += sum(index["doc_end_flag"])
    assert documents == 30

    window = next(shards.windows(64))
    assert window.tokens.shape == (64,) and window.chunk_of_token.min() == 0
    assert window.concepts.shape == (len(window.chunk_ids), shards.n_concepts)
    first = shards.index(0)
    ids = first["concepts"][: len(window.chunk_ids)]
    assert [set(np.flatnonzero(row)) for row in window.concepts] == [set(c) for c in ids]


def test_chunk_stream_by_hand():
    stream, spans = chunk_stream([[5, 6], [7]], [False, True])
    assert stream.tolist() == [BOS, 5, 6, EOC, BOS, 7, EOC, ENDOFTEXT] and spans.tolist() == [[0, 4], [4, 8]]


def test_owned_rows_leave_shared_storage_chunks_to_finish():
    assert owned_rows(0, 3, 4, 10) == (0, 0)  # inside one chunk that the next shard shares
    assert owned_rows(2, 9, 4, 10) == (4, 8)
    assert owned_rows(3, 10, 4, 10) == (4, 10)  # the short last chunk belongs to the last shard


@pytest.mark.slow
def test_annotate_killed_and_rerun_gives_identical_outputs(corpus, trained, tmp_path):
    reference = corpus_outputs(corpus[2].root)
    path, config = copy_run(trained, tmp_path, **SMALL)
    markers = RunDir(config.run_dir).output_dir("annotated") / "_shards"
    command = [sys.executable, "-m", "atlas.cli", "run", str(path), "--stages", "annotate,tokenize", "--inline",
               "--no-progress"]
    process = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and (not markers.exists() or not list(markers.glob("*.json"))):
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    shards = len(list(RunDir(config.run_dir).output_dir("chunks").glob("part-*.parquet")))
    assert 1 <= len(list(markers.glob("*.json"))) < shards, "the kill must land in the middle of annotation"
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    files, arrays = corpus_outputs(RunDir(config.run_dir).root)
    assert files == reference[0]
    for name, values in reference[1].items():
        np.testing.assert_array_equal(arrays[name], values)


@pytest.mark.slow
def test_index_search_and_export(corpus, capsys):
    import json

    import pyarrow.parquet as pq
    from scipy import sparse

    from atlas.cli import main

    _, config, run = corpus
    run_stages(config, ["index"], log=lambda m: None)
    info = json.loads((run.output_dir("index") / "_index.json").read_text())
    assert info["recall_at_10"] >= 0.95 and info["nprobe"] == 16
    id_map = pq.read_table(run.part_path("index", 0)).column("chunk_id").to_pylist()
    assert id_map == open_embeddings(run.root)["chunk_id"][:].tolist()

    texts = (ds.dataset(run.output_dir("annotated"), format="parquet").to_table(columns=["chunk_id", "text"])
             .to_pydict())
    capsys.readouterr()
    assert main(["search", str(run.root), texts["text"][3], "-k", "3"]) == 0
    out = capsys.readouterr().out
    assert texts["chunk_id"][3] in out and " 1. " in out  # a chunk finds itself

    out_dir = run.root.parent / "release"
    assert main(["export", str(run.root), str(out_dir)]) == 0
    concepts = pq.read_table(out_dir / "concepts.parquet").to_pylist()
    assert [c["concept_id"] for c in concepts] == list(range(len(concepts)))
    assert set(pq.read_schema(out_dir / "concepts.parquet").names) == {
        "concept_id", "type", "is_tone", "is_alignment", "is_demographic", "name", "description", "taxonomy_path",
        "chunk_count", "prevalence"}
    guide = pq.read_table(out_dir / "field_guide").to_pydict()
    annotated = ds.dataset(run.output_dir("annotated"), format="parquet").to_table(
        columns=["chunk_id", "concepts"]).to_pydict()
    carriers = {}
    for chunk, ids in zip(annotated["chunk_id"], annotated["concepts"]):
        for g in ids:
            carriers.setdefault(g, []).append(chunk)
    for concept, chunks in zip(guide["concept_id"], guide["chunk_ids"]):
        assert chunks == carriers.get(concept, []) and len(chunks) == concepts[concept]["chunk_count"]
    matrix = sparse.load_npz(out_dir / "cooccurrence.npz")
    assert matrix.shape == (len(concepts), len(concepts)) and (matrix != matrix.T).nnz == 0
    assert matrix.diagonal().tolist() == [c["chunk_count"] for c in concepts]
    assert pq.read_table(out_dir / "chunks").num_rows == len(annotated["chunk_id"])
