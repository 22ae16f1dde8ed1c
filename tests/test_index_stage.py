"""The ``index`` stage as map + merge, on a hand-made run: embeddings of 5 annotate shards (one of them empty).

It trains in ``plan``, adds each shard in ``run_shard`` and merges in ``finalize``; the index must be the one-process
build's, and every way of resuming a killed run must leave the same bytes.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from atlas.config import AtlasConfig
from atlas.core.files import atomic_write_json
from atlas.core.rundir import RunDir
from atlas.io import layout
from atlas.io.cards import CONFIGS_FILE
from atlas.io.embedding_store import create_store, finish, write_rows
from atlas.runner import run_stages

pytest.importorskip("faiss")
zarr = pytest.importorskip("zarr")

D = 32
SHARD_ROWS = [1500, 2200, 0, 1800, 2500]  # annotate shards; an empty one too (every chunk of it rejected)
N = sum(SHARD_ROWS)
ANNOTATE_HASH = "annotate-hash"


def clustered_vectors(n: int, d: int, seed: int) -> np.ndarray:
    """Unit vectors around 50 random centres (float16, as embeddings.zarr holds them)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((50, d))
    x = centres[rng.integers(0, 50, n)] + 0.5 * rng.standard_normal((n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16)


def make_run(root) -> tuple[AtlasConfig, np.ndarray]:
    """A run directory whose annotate stage is done: its manifest record, _SUCCESS and embeddings.zarr."""
    config = AtlasConfig(run_dir=str(root), execution={"orchestrator": "inline", "progress": False},
                         index={"code_bytes": 8})
    run = RunDir(root)
    vectors = clustered_vectors(N, D, seed=0)
    offsets = np.concatenate([[0], np.cumsum(SHARD_ROWS)[:-1]]).tolist()
    store = run.root / layout.EMBEDDINGS
    create_store(store, N, D, 700, {"stage_hash": ANNOTATE_HASH, "encoder": "test", "shard_offsets": offsets})
    for shard, (start, rows) in enumerate(zip(offsets, SHARD_ROWS)):
        ids = np.array([f"doc{row // 3}:{row % 3:05d}" for row in range(start, start + rows)], dtype=np.str_)
        write_rows(store, shard, start, start + rows, {
            "embeddings": vectors[start:start + rows], "chunk_id": ids,
            "doc_id": np.array([i.split(":")[0] for i in ids], dtype=np.str_),
            "source_doc_id": np.array([i.split(":")[0] for i in ids], dtype=np.str_),
            "data_src": np.full(rows, "test", dtype=np.str_)})
    finish(store, len(SHARD_ROWS))
    run.write_manifest({"name": "test", "config": config.model_dump(), "stages": {"annotate": {
        "hash": ANNOTATE_HASH, "num_shards": len(SHARD_ROWS), "output": layout.ANNOTATED, "status": "done"}}})
    run.mark_stage_done(layout.ANNOTATED, ANNOTATE_HASH)
    return config, vectors


def index_files(run: RunDir) -> dict[str, bytes]:
    """What the index folder holds, byte for byte, but the bookkeeping (markers, counters) and timings."""
    files = {}
    for path in sorted(run.output_dir(layout.INDEX).rglob("*")):
        rel = str(path.relative_to(run.output_dir(layout.INDEX)))
        if path.is_file() and not rel.startswith("_shards") and path.name != "_stats.json":
            data = path.read_bytes()
            if path.suffix == ".json":
                data = json.dumps({k: v for k, v in json.loads(data).items() if "seconds" not in k
                                   and k != "trained"}, sort_keys=True).encode()
            files[rel] = data
    return files


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("index_stage") / "run"
    config, vectors = make_run(root)
    reports = run_stages(config, ["index"], log=lambda m: None)
    return config, vectors, RunDir(root), reports[0], index_files(RunDir(root))


def test_one_shard_per_annotate_shard_and_the_outputs(built):
    config, vectors, run, report, files = built
    assert report.num_shards == len(SHARD_ROWS) and report.ran == list(range(len(SHARD_ROWS)))
    assert sorted(files) == [CONFIGS_FILE, "_README.md", "_SUCCESS", "_index.json", "_plan.json", "index.faiss",
                             "part-00000.parquet", "trained.faiss"]  # no parts, build folder or temporary file left
    counters = json.loads(run.stats_path(layout.INDEX).read_text())["counters"]
    assert counters["vectors"] == N and counters["nlist"] == 128  # nlist_for(8000)
    assert [run.shard_marker(layout.INDEX, s)["counters"]["vectors"] for s in range(5)] == SHARD_ROWS
    info = json.loads((run.output_dir(layout.INDEX) / "_index.json").read_text())
    assert (info["n"], info["parts"], info["nprobe"], info["on_disk"]) == (N, 5, 16, False)
    assert info["recall_at_10"] >= 0.9 and counters["recall_at_10_permille"] == round(1000 * info["recall_at_10"])
    id_map = pq.read_table(run.part_path(layout.INDEX, 0))
    assert id_map.column_names == ["chunk_id", "doc_id", "data_src"]
    assert id_map.column("chunk_id").to_pylist() == [f"doc{r // 3}:{r % 3:05d}" for r in range(N)]


def test_the_index_is_the_one_process_build(built, tmp_path):
    """Trained on the same seeded sample, shards added in row order, merged in shard order: byte for byte the index
    build_ivfpq makes from the same vectors in one process."""
    from atlas.models.ivfpq import build_ivfpq

    config, vectors, run, _, files = built
    build_ivfpq(vectors, tmp_path, code_bytes=8, seed=config.index.seed)
    assert (tmp_path / "index.faiss").read_bytes() == files["index.faiss"]


def test_rerun_is_a_no_op(built):
    config, _, run, _, files = built
    report = run_stages(config, ["index"], log=lambda m: None)[0]
    assert report.skipped and index_files(run) == files


@pytest.mark.parametrize("killed", ["in_plan", "in_shards", "in_finalize", "after_finalize"])
def test_a_killed_run_resumes_to_the_same_bytes(built, tmp_path, killed):
    """The states a SIGKILL can leave (_SUCCESS not written yet), rerun: every index file comes out the same."""
    from atlas.stages.index import IndexStage

    config, _, run, _, files = built
    root = tmp_path / "run"
    shutil.copytree(run.root, root)
    config = config.model_copy(update={"run_dir": str(root)})
    copy = RunDir(root)
    folder = copy.output_dir(layout.INDEX)
    copy.success_path(layout.INDEX).unlink()
    if killed == "in_plan":  # while training: trained again, and every shard redone
        (folder / "trained.faiss").unlink()
        (folder / "_plan.json").unlink()
        (folder / ".trained.faiss.tmp").write_bytes(b"half a file")
    elif killed == "in_shards":  # shards 0 and 3 finished, 1 was writing its part; the merged index is stale
        for shard in (1, 2, 4):
            copy.marker_path(layout.INDEX, shard).unlink()
        for shard in (0, 3):
            IndexStage(config).run_shard(copy, shard)
        (folder / "_parts" / ".shard-00001.npz.tmp").write_bytes(b"half a part")
        (folder / "index.faiss").write_bytes(b"an index of another run")
    elif killed == "in_finalize":  # published, the parts still there: merged again, over a half-written build
        for shard in range(len(SHARD_ROWS)):
            IndexStage(config).run_shard(copy, shard)
        (folder / "_index.json").unlink()
        (folder / ".build").mkdir()
        (folder / ".build" / "index.faiss").write_bytes(b"half an index")
    else:  # the parts were being deleted: nothing to merge, the index is there
        (folder / "_parts.merged").mkdir()
        (folder / "_parts.merged" / "shard-00004.npz").write_bytes(b"a part not deleted yet")
    report = run_stages(config, ["index"], log=lambda m: None)[0]
    assert not report.skipped
    assert index_files(copy) == files
    left = [p.name for p in folder.iterdir() if p.name.startswith((".", "_parts")) and p.name != CONFIGS_FILE]
    assert left == []  # no temporary or part left (the card's configs file is no temporary)


def test_shards_need_a_plan_made_after_annotate(tmp_path):
    """Planned ahead of the annotate stage (atlas plan for a SLURM array), the index is not trained yet: the plan
    is the annotate stage's shard count, and a shard run before the real plan says what to do."""
    from atlas.core.files import ArtifactError
    from atlas.stages.index import IndexStage

    config, _ = make_run(tmp_path / "run")
    run = RunDir(config.run_dir)
    run.success_path(layout.ANNOTATED).unlink()
    folder = run.output_dir(layout.INDEX)
    atomic_write_json(folder / "_plan.json", {"stage_hash": "an earlier run's"})
    stage = IndexStage(config)
    assert stage.plan(run, "h") == len(SHARD_ROWS)
    assert not (folder / "trained.faiss").exists() and not (folder / "_plan.json").exists()
    with pytest.raises(ArtifactError, match="atlas plan CONFIG --stages index"):
        stage.run_shard(run, 0)
