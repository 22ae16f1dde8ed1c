"""atlas.api: the calls of README's "Use from Python" on a small real run, checked against the run's own files."""

from __future__ import annotations

import logging

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import write_config
from test_corpus import copy_run

import atlas
import atlas.api as api
from atlas.core.files import atomic_write_parquet, read_json
from atlas.core.rundir import RunDir
from atlas.io import layout

pytest.importorskip("faiss")


@pytest.fixture(scope="module")
def finished(trained, tmp_path_factory):
    """A copy of ``trained`` cut to 12 chunks per shard, annotated, tokenized and indexed through ``api.run``."""
    path, _ = copy_run(trained, tmp_path_factory.mktemp("api"))
    run_dir = path.parent / "run"
    for part in RunDir(run_dir).parts(layout.CHUNKS):  # small and fast
        atomic_write_parquet(part, pq.read_table(part).slice(0, 12))
    # --set values as keywords (small blocks: several per shard), --run-dir as run_dir
    config = api.load_config(path, run_dir=run_dir, annotate__zarr_chunk_rows=7, annotate__block_rows=5,
                             tokenize__block_rows=6, **{"index.code_bytes": 8})
    return config, api.run(config, ["annotate", "tokenize", "index"])


def rows_in_parts(run: api.Run, output: str) -> int:
    return sum(pq.ParquetFile(p).metadata.num_rows for p in run.dir.parts(output))


def test_the_readme_calls(finished):
    config, run = finished
    assert isinstance(run, api.Run) and run.path == RunDir(config.run_dir).root
    assert {s["stage"]: s["state"] for s in run.status()}["index"] == "done"

    annotated = run.table("annotate")
    assert annotated.num_rows == rows_in_parts(run, layout.ANNOTATED) == 36  # 3 shards of 12 chunks
    assert run.table("annotated", columns=["chunk_id"]).column_names == ["chunk_id"]  # its folder's name works too
    batches = list(run.batches("annotate", columns=["chunk_id", "concepts"], batch_size=5))
    assert max(b.num_rows for b in batches) <= 5
    assert [i for b in batches for i in b.column("chunk_id").to_pylist()] == annotated.column("chunk_id").to_pylist()

    concepts = run.library()
    assert concepts.num_rows == read_json(run.dir.output_dir(layout.LIBRARY) / "config.json")["n_concepts"] > 0
    names = concepts.column("name").to_pylist()

    # The annotator gives a chunk's text the concepts the annotate stage gave that chunk, with the same scores.
    rows = annotated.slice(0, 4).to_pylist()
    labels = run.annotate([r["text"] for r in rows])
    assert sum(map(len, labels)) > 0
    for row, given in zip(rows, labels):
        assert [a.concept_id for a in given] == row["concepts"]
        assert [a.concept for a in given] == [names[g] for g in row["concepts"]]
        np.testing.assert_allclose([a.score for a in given], row["concept_scores"], atol=1e-3)
        assert {a.domain for a in given} <= set(concepts.column("domain").to_pylist())

    hits = run.search(rows[2]["text"], k=3)
    assert len(hits) == 3 and hits[0]["chunk_id"] == rows[2]["chunk_id"]  # a chunk finds itself
    assert {h["chunk_id"] for h in hits} <= set(annotated.column("chunk_id").to_pylist())

    windows = list(run.token_windows(16, stride=8))
    streams = [int(pq.read_table(p, columns=["token_end"]).column(0)[-1].as_py())
               for p in run.dir.parts(layout.TOKENS)]
    assert len(windows) == sum((n - 16) // 8 + 1 for n in streams if n >= 16) > 0
    for window in windows:
        assert window.tokens.shape == window.chunk_of_token.shape == (16,)
        assert window.concepts.shape == (len(window.chunk_ids), concepts.num_rows)
        assert set(window.chunk_ids) <= set(annotated.column("chunk_id").to_pylist())


def test_a_second_run_logs_that_nothing_is_left(finished, caplog):
    config, run = finished
    with caplog.at_level(logging.INFO, logger="atlas"):
        api.run(config, ["annotate", "tokenize", "index"])
    assert [r.name for r in caplog.records] == ["atlas.runner"] * 3  # the report exists: it is not rewritten
    assert all("already done" in r.getMessage() for r in caplog.records)


def test_only_finished_stages_with_parts_are_read(trained, finished, tmp_path):
    _, run = finished
    with pytest.raises(api.StageNotDone, match="stage 'annotate' is not started"):
        api.Run(trained[1].root).table("annotate")  # the trained run stops at train_annotator
    with pytest.raises(api.StageNotDone, match="stage 'tokenize' is not started"):
        next(api.Run(trained[1].root).token_windows(16))
    with pytest.raises(ValueError, match="writes no Parquet parts"):
        run.table("library")
    with pytest.raises(ValueError, match="unknown stage 'anotate'"):
        run.table("anotate")
    with pytest.raises(FileNotFoundError, match="not an Atlas run directory"):
        api.Run(tmp_path)


def test_load_config_takes_the_cli_overrides(tmp_path, monkeypatch):
    (tmp_path / "configs").mkdir()
    path = write_config(tmp_path / "configs", tmp_path / "configs" / "docs.jsonl")
    monkeypatch.chdir(tmp_path)
    config = api.load_config(path, input="docs.jsonl", run_dir="elsewhere", tag__batch_size=7,
                             **{"chunk.domains.web.max_tokens": 99, "name": "123"})
    assert config.input.path == str(tmp_path / "docs.jsonl")  # relative to the working directory, as --input
    assert config.run_dir == str(tmp_path / "elsewhere")
    assert config.tag.batch_size == 7 and config.chunk.domains["web"].max_tokens == 99
    assert config.name == "123"  # a string stays a string
    assert atlas.load_config is api.load_config and atlas.run is api.run and atlas.Run is api.Run
