"""Coherence and label read the corpus-sized tables in bounded passes: the results do not depend on the pass size."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from atlas.config import config_from_dict
from atlas.core.rundir import RunDir
from atlas.io.outofcore import budget_slices
from atlas.io.tags import float_rows
from atlas.stages import STAGES, coherence, label


def test_float_rows_reads_a_memory_map_row_by_row(tmp_path):
    x = np.random.default_rng(0).normal(size=(50, 8)).astype(np.float16)
    np.save(tmp_path / "x.npy", x)
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    rows = np.array([7, 3, 3, 49, 0])
    assert np.array_equal(float_rows(mapped, rows), x[rows].astype(np.float32))
    assert float_rows(mapped, rows).dtype == np.float32
    assert np.array_equal(float_rows(mapped[10:], rows[:2]), x[10:][rows[:2]].astype(np.float32))  # a view
    assert np.array_equal(float_rows(x, rows), x[rows].astype(np.float32))


@pytest.mark.slow  # the trained run loads the embedding model
def test_many_small_passes_give_the_same_bytes(run_copy, monkeypatch):
    """A pass size of 50 (tag, chunk) pairs splits the clusters, the background's chunk ids and the label's top tags
    into many passes and ranges; the outputs are those of one pass."""
    run = RunDir(run_copy)
    config = config_from_dict(json.loads((run_copy / "manifest.json").read_text())["config"])
    outputs = [run.part_path("coherence", 0), run.rejects_path("coherence", 0), run.part_path("labels", 0)]

    def rerun() -> list[bytes | None]:
        for name in ("coherence", "label"):
            stage = STAGES[name](config)
            stage.setup()
            try:
                stage.run_shard(run, 0)
            finally:
                stage.teardown()
        return [p.read_bytes() if p.exists() else None for p in outputs]

    # "before" is a rerun in one pass, not the trained run's files: other stages (and tests) add chunk embeddings
    # to the run's cache in other batches, and an encoder's output depends in the last bits on a text's batch
    before = rerun()
    assert pq.read_metadata(outputs[2]).num_rows > 1  # clusters were kept and labelled
    passes = []

    def counted(lengths, budget):
        slices = list(budget_slices(lengths, budget))
        passes.append(len(slices))
        return slices

    for module in (coherence, label):
        monkeypatch.setattr(module, "PAIRS_PER_PASS", 50)
        monkeypatch.setattr(module, "budget_slices", counted)
    after = rerun()
    assert len(passes) == 2 and min(passes) > 1
    assert after == before
