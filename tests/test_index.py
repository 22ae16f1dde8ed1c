"""The IVFPQ attribution index: sizing rules, in-memory and on-disk builds, map + merge builds, loading, search,
self-recall, inputs."""

from __future__ import annotations

import shutil

import faiss
import numpy as np
import pytest

import atlas.models.ivfpq
from atlas.core.files import ArtifactError
from atlas.models.ivfpq import (
    INDEX_FILE,
    INVLISTS_FILE,
    add_part,
    build_ivfpq,
    load_index,
    merge_parts,
    nlist_for,
    pq_m_for,
    search,
    self_recall,
    train_ivfpq,
)

N, D = 20_000, 64
# 8-byte codes (8 dims per sub-quantizer, one of FAISS' fast cases) keep the two 20k builds to a second or two; one
# thread, because spinning OpenMP threads on a busy 2-core machine can make 2 threads several times slower than 1.
# The module's 64-byte default is exercised by benchmarks/bench_index.py.
BUILD = {"code_bytes": 8, "seed": 0, "threads": 1}


def unit_vectors(n: int, d: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def vectors() -> np.ndarray:
    return unit_vectors(N, D, seed=0)


@pytest.fixture(scope="module")
def built(vectors, tmp_path_factory) -> dict:
    """The same vectors indexed twice: lists in index.faiss, and lists merged on disk from 4 part files (of 2 batches
    of 3,000 rows each, the last one shorter)."""
    root = tmp_path_factory.mktemp("index")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(atlas.models.ivfpq, "PART_ROWS", 6000)
        disk = build_ivfpq(vectors, root / "disk", on_disk=True, batch_size=3000, **BUILD)
    mem = build_ivfpq(vectors, root / "mem", on_disk=False, **BUILD)
    return {"mem": (root / "mem", mem), "disk": (root / "disk", disk)}


@pytest.mark.parametrize(("n", "expected"), [
    (1, 1), (38, 1), (39, 1), (78, 2), (1000, 16), (10_000, 256), (20_000, 512), (1_000_000, 4096),
    (100_000_000, 32768),
])
def test_nlist_for_examples(n, expected):
    assert nlist_for(n) == expected


def test_nlist_for_rule():
    for n in [1, 7, 39, 100, 999, 5000, 12_345, 77_777, 250_000, 3_000_000, 10**9]:
        nlist = nlist_for(n)
        assert nlist >= 1 and nlist & (nlist - 1) == 0, (n, nlist)  # a power of two
        assert nlist <= max(1, n // 39), (n, nlist)  # >= 39 training points per centroid
        # ~4 sqrt(n): within a factor sqrt(2) of it (nearest power of two), unless the 39-points cap binds
        assert nlist == 1 or nlist <= 4 * n**0.5 * 2**0.5, (n, nlist)
        if n // 39 >= 2 * 4 * n**0.5:
            assert 4 * n**0.5 / 2**0.5 <= nlist, (n, nlist)
    with pytest.raises(ValueError):
        nlist_for(0)


@pytest.mark.parametrize(("d", "code_bytes", "expected"), [
    (384, 64, 64), (768, 64, 64), (384, 32, 32), (64, 64, 64), (64, 16, 16), (100, 64, 50), (97, 64, 1),
    (48, 64, 48), (384, 7, 6),
])
def test_pq_m_for(d, code_bytes, expected):
    m = pq_m_for(d, code_bytes)
    assert m == expected and d % m == 0 and m <= code_bytes


def test_files_and_stats(built):
    for variant, (folder, stats) in built.items():
        names = sorted(p.name for p in folder.iterdir())
        expected = [INDEX_FILE, INVLISTS_FILE] if variant == "disk" else [INDEX_FILE]
        assert names == sorted(expected), names  # no temporary files, build folders or part files left
        assert stats["files"] == expected
        assert stats["on_disk"] == (variant == "disk")
        assert (stats["n"], stats["d"], stats["nlist"], stats["m"], stats["code_bytes"]) == (N, D, 512, 8, 8)
        assert stats["train_size"] == N  # max(39 * 512, 50,000), capped at n
        assert stats["bytes"] == sum((folder / name).stat().st_size for name in expected)
        assert stats["bytes_per_vector"] == pytest.approx(stats["bytes"] / N)
        # 8 bytes of code + 8 bytes of id per vector, plus centroids, codebooks and a few words per list
        assert 16 <= stats["bytes_per_vector"] < 16 + (512 * D * 4 + 256 * D * 4 + 512 * 64 + 4096) / N
        assert stats["train_seconds"] >= 0 and stats["add_seconds"] >= 0
    # The on-disk index.faiss holds no lists: only the centroids and codebooks.
    disk_folder = built["disk"][0]
    assert (disk_folder / INDEX_FILE).stat().st_size < (built["mem"][0] / INDEX_FILE).stat().st_size / 2


def test_self_recall(built, vectors):
    for variant, (folder, _) in built.items():
        index = load_index(folder, nprobe=16)
        assert index.ntotal == N
        assert faiss.extract_index_ivf(index).nprobe == 16
        recall = self_recall(index, vectors, sample=1000, k=10, nprobe=16)
        assert recall >= 0.95, (variant, recall)


def test_on_disk_matches_in_memory(built, vectors):
    """Both builds train on the same seeded sample with seeded k-means, so they have the same centroids and codebooks,
    encode every row identically, and the merge keeps each list in row order, as adding in row order does: the two
    indexes hold the same lists and return the same neighbours with the same scores, not just nearly."""
    queries = vectors[::997][:20]
    results = {variant: search(load_index(folder), queries, k=10) for variant, (folder, _) in built.items()}
    assert np.array_equal(results["mem"][1], results["disk"][1])
    np.testing.assert_allclose(results["mem"][0], results["disk"][0], rtol=0, atol=1e-6)
    # Loading into memory (no mmap) changes nothing either.
    scores, rows = search(load_index(built["mem"][0], mmap=False), queries, k=10)
    assert np.array_equal(rows, results["mem"][1])


@pytest.mark.parametrize(("d", "code_bytes", "nlist"), [(64, 8, 300), (24, 4, 8), (32, 8, 1)])
def test_fast_encoder_matches_faiss(d, code_bytes, nlist):
    """build_ivfpq encodes through its own BLAS path (_Encoder): the codes must be FAISS' sa_encode's, byte for byte,
    for sub-vectors of 8 dims (a fast FAISS kernel), 6 dims (the slow one, as with 384 dims in 64 bytes) and 4 dims
    with nlist 1 (no list number bytes)."""
    from atlas.models.ivfpq import _Encoder, _train

    x = unit_vectors(2000, d, seed=5)
    index = _train(x, len(x), d, nlist, pq_m_for(d, code_bytes), len(x), 1000, seed=0)
    assert np.array_equal(_Encoder(index)(x), index.sa_encode(x))


def test_search_shapes_nprobe_and_rerank(built, vectors):
    folder, _ = built["mem"]
    index = load_index(folder, nprobe=4)
    scores, rows = search(index, vectors[5], k=3)  # a single 1-D query
    assert scores.shape == rows.shape == (1, 3) and scores.dtype == np.float32 and rows.dtype == np.int64
    assert rows[0, 0] == 5 and np.all(np.diff(scores[0]) <= 0)
    # Per-call nprobe does not change the index's own setting.
    search(index, vectors[:2], k=3, nprobe=64)
    assert faiss.extract_index_ivf(index).nprobe == 4
    # Queries are normalized: scaling one changes nothing.
    assert np.array_equal(search(index, 3 * vectors[:4], k=5)[1], search(index, vectors[:4], k=5)[1])
    # Re-ranking scores candidates exactly: the row itself comes first with cosine 1.
    scores, rows = search(index, vectors[:50], k=10, rerank=50, vectors=vectors)
    assert np.array_equal(rows[:, 0], np.arange(50))
    np.testing.assert_allclose(scores[:, 0], 1.0, atol=1e-5)
    assert np.all(np.diff(scores, axis=1) <= 0)
    assert self_recall(index, vectors, sample=200, nprobe=4, rerank=40) == 1.0
    with pytest.raises(ValueError, match="rerank needs"):
        search(index, vectors[:2], rerank=40)
    with pytest.raises(ValueError, match="shape"):
        search(index, np.ones((2, D + 1), np.float32))


def test_folder_can_move_and_missing_lists_are_named(built, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(built["disk"][0], moved)
    index = load_index(moved)
    lists = faiss.downcast_InvertedLists(faiss.extract_index_ivf(index).invlists)
    assert isinstance(lists, faiss.OnDiskInvertedLists) and lists.filename == str(moved / INVLISTS_FILE)
    assert index.ntotal == N
    del index, lists
    (moved / INVLISTS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=INVLISTS_FILE):
        load_index(moved)


def test_missing_folder_is_a_clear_error(tmp_path):
    missing = tmp_path / "no" / "such" / "index"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_index(missing)


def test_zarr_float16_input(tmp_path):
    """A float16 zarr array (as embeddings.zarr stores chunks) is read in batches and sampled by orthogonal selection;
    it gives the same index as the same float16 values in a numpy array."""
    zarr = pytest.importorskip("zarr")
    x16 = unit_vectors(4000, D, seed=1).astype(np.float16)
    array = zarr.create_array(store=str(tmp_path / "embeddings.zarr"), shape=x16.shape, chunks=(700, D),
                              dtype="float16")
    array[:] = x16
    options = {"code_bytes": 8, "batch_size": 1500, "seed": 3, "threads": 1}
    stats = build_ivfpq(array, tmp_path / "from_zarr", **options)
    build_ivfpq(x16, tmp_path / "from_numpy", **options)
    assert (stats["n"], stats["d"], stats["nlist"], stats["on_disk"]) == (4000, D, 64, False)
    from_zarr, from_numpy = load_index(tmp_path / "from_zarr"), load_index(tmp_path / "from_numpy")
    assert self_recall(from_zarr, array, sample=500) >= 0.95
    queries = x16[:25].astype(np.float32)
    assert np.array_equal(search(from_zarr, queries)[1], search(from_numpy, queries)[1])
    # Re-ranking reads the candidates' stored vectors back from zarr.
    assert np.array_equal(search(from_zarr, queries, rerank=30, vectors=array)[1][:, 0], np.arange(25))


def test_on_disk_parts_hold_lists_only(tmp_path, monkeypatch):
    """Each part file holds its rows' codes and ids, and list sizes, nothing else: no copy of the coarse centroids (a
    partial index would carry nlist * d * 4 bytes per part, 16 KB here, as much as the codes)."""
    monkeypatch.setattr(atlas.models.ivfpq, "PART_ROWS", 1000)
    x = unit_vectors(3000, D, seed=6)
    seen = {}

    def progress(done: int, n: int) -> None:
        seen[done] = []
        for path in sorted(tmp_path.glob(".build/part-*")):
            with np.load(path) as part:
                shapes = tuple(part[name].shape for name in ("list_sizes", "ids", "codes"))
            seen[done].append((path.name, shapes, path.stat().st_size))

    stats = build_ivfpq(x, tmp_path, on_disk=True, batch_size=1000, code_bytes=8, threads=1, progress=progress)
    assert list(seen) == [1000, 2000, 3000]
    assert [name for name, _, _ in seen[3000]] == ["part-000000.npz", "part-000001.npz"]  # the last one comes next
    for _, shapes, size in seen[3000]:
        assert shapes == ((64,), (1000,), (1000, 8))
        assert size < 1000 * (8 + 8) + 64 * 8 + 1024  # + the zip and .npy headers
    assert stats["bytes"] < 3000 * 16 + stats["nlist"] * (D * 4 + 64) + 256 * D * 4 + 4096
    index = load_index(tmp_path)
    assert index.ntotal == 3000 and self_recall(index, x, sample=300) >= 0.95


def test_rebuild_replaces_and_switches_layout(vectors, tmp_path):
    small = vectors[:3000]
    disk = build_ivfpq(small, tmp_path, on_disk=True, batch_size=1000, code_bytes=8, threads=1)
    assert disk["files"] == [INDEX_FILE, INVLISTS_FILE]
    mem = build_ivfpq(small, tmp_path, on_disk=False, code_bytes=8, threads=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [INDEX_FILE]  # the stale lists file went too
    assert mem["on_disk"] is False and load_index(tmp_path).ntotal == 3000


def test_tiny_input_and_missing_results(tmp_path):
    """Fewer rows than the 256 codewords of a sub-quantizer still build (the sample is repeated); a query whose
    probed lists hold fewer than k vectors gets rows -1 with score -inf."""
    x = unit_vectors(100, D, seed=2)
    stats = build_ivfpq(x, tmp_path, code_bytes=8, threads=1)
    assert stats["nlist"] == 2 and stats["n"] == 100
    index = load_index(tmp_path, nprobe=1)
    scores, rows = search(index, x[:5], k=150)
    assert np.all(rows[:, 100:] == -1) and np.all(np.isneginf(scores[:, 100:]))
    assert np.all(rows[:, :40] >= 0)
    assert self_recall(index, x, k=10, nprobe=2) >= 0.95


def test_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="norm"):
        build_ivfpq(np.full((500, 8), 0.5, np.float32), tmp_path)  # norm 1.41: not normalized
    with pytest.raises(ValueError, match="norm"):
        build_ivfpq(np.zeros((500, 8), np.float32), tmp_path)
    with pytest.raises(ValueError, match="shape"):
        build_ivfpq(np.zeros((0, 8), np.float32), tmp_path)
    with pytest.raises(ValueError, match="nlist"):
        build_ivfpq(unit_vectors(500, 8, seed=0), tmp_path, nlist=501)
    assert not (tmp_path / INDEX_FILE).exists()
    assert not (tmp_path / ".build").exists()


def test_deterministic_whatever_the_threads(tmp_path):
    """Same input and seed, same index file byte for byte, with 1 or 2 threads; the thread setting is restored."""
    before = faiss.omp_get_max_threads()
    x = unit_vectors(3000, 16, seed=4)
    build_ivfpq(x, tmp_path / "one", code_bytes=4, threads=1)
    assert faiss.omp_get_max_threads() == before
    build_ivfpq(x, tmp_path / "two", code_bytes=4, threads=2)
    assert faiss.omp_get_max_threads() == before
    assert (tmp_path / "one" / INDEX_FILE).read_bytes() == (tmp_path / "two" / INDEX_FILE).read_bytes()


# --- map + merge -----------------------------------------------------------------------------------------------------


def clustered_vectors(n: int, d: int, seed: int) -> np.ndarray:
    """Unit vectors around 200 random centres, closer to real embeddings than uniform noise. The spread makes the
    8-byte codes miss a few rows' own top 10 (self-recall ~0.97, the paper's figure): near 1, equal recalls would
    say less."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((200, d), dtype=np.float32)
    x = centres[rng.integers(0, 200, n)] + 0.3 * rng.standard_normal((n, d), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def map_merge(tmp_path_factory) -> dict:
    """20,000 clustered vectors indexed twice: in one process (build_ivfpq), and as map + merge in 4 shards of uneven
    sizes (trained once, each shard encoded into its own part, the parts merged in memory and on disk)."""
    root = tmp_path_factory.mktemp("map_merge")
    x = clustered_vectors(N, D, seed=7)
    single = build_ivfpq(x, root / "single", **BUILD)
    trained = train_ivfpq(x, root / "trained.faiss", **BUILD)
    bounds = [0, 3000, 10_000, 12_500, N]
    parts = [root / "parts" / f"shard-{i:05d}.npz" for i in range(4)]
    added = [add_part(root / "trained.faiss", x, a, b, part, batch_size=2048, threads=1)
             for a, b, part in zip(bounds, bounds[1:], parts)]
    merged = {on_disk: merge_parts(root / "trained.faiss", parts, root / f"merged-{on_disk}", on_disk=on_disk)
              for on_disk in (False, True)}
    return {"x": x, "root": root, "single": single, "trained": trained, "added": added, "parts": parts,
            "merged": merged}


def test_map_merge_recall_equals_the_single_build(map_merge):
    x, root = map_merge["x"], map_merge["root"]
    assert map_merge["added"] == [3000, 7000, 2500, 7500]
    single = self_recall(load_index(root / "single"), x, sample=1000, k=10, nprobe=16)
    for on_disk in (False, True):
        stats = map_merge["merged"][on_disk]
        assert (stats["n"], stats["nlist"], stats["parts"], stats["on_disk"]) == (N, 512, 4, on_disk)
        merged = self_recall(load_index(root / f"merged-{on_disk}"), x, sample=1000, k=10, nprobe=16)
        assert merged >= 0.9 and abs(merged - single) <= 0.002, (on_disk, merged, single)


def test_map_merge_equals_one_in_process_add(map_merge):
    """The merged lists are those FAISS itself makes adding every vector in row order to the same trained index:
    same neighbours, same scores. The in-memory merge is even byte for byte build_ivfpq's index file, whose training
    train_ivfpq repeats."""
    import faiss

    x, root = map_merge["x"], map_merge["root"]
    reference = faiss.read_index(str(root / "trained.faiss"))
    reference.add_with_ids(x, np.arange(N, dtype=np.int64))
    faiss.extract_index_ivf(reference).nprobe = 16
    queries = x[::499][:40]
    expected = search(reference, queries, k=10)
    for on_disk in (False, True):
        scores, rows = search(load_index(root / f"merged-{on_disk}"), queries, k=10)
        assert np.array_equal(rows, expected[1]), on_disk
        np.testing.assert_allclose(scores, expected[0], rtol=0, atol=1e-6)
    assert (root / "merged-False" / INDEX_FILE).read_bytes() == (root / "single" / INDEX_FILE).read_bytes()
    assert sorted(p.name for p in (root / "merged-True").iterdir()) == [INDEX_FILE, INVLISTS_FILE]


def test_trained_index_and_parts(map_merge):
    """train_ivfpq writes an empty trained index (centroids and codebooks); a part holds its rows' lists only."""
    root, trained = map_merge["root"], map_merge["trained"]
    assert (trained["n"], trained["d"], trained["nlist"], trained["m"], trained["train_size"]) == (N, D, 512, 8, N)
    index = faiss.read_index(str(root / "trained.faiss"))
    assert index.is_trained and index.ntotal == 0
    with np.load(map_merge["parts"][1]) as part:
        sizes, ids, codes = part["list_sizes"], part["ids"], part["codes"]
    assert sizes.shape == (512,) and sizes.sum() == 7000 and codes.shape == (7000, 8)
    assert sorted(ids.tolist()) == list(range(3000, 10_000))  # global row numbers
    first = np.cumsum(sizes) - sizes
    for list_no in np.flatnonzero(sizes)[:20]:  # grouped by list, in row order within a list
        in_list = ids[first[list_no]:first[list_no] + sizes[list_no]]
        assert np.all(np.diff(in_list) > 0)


def test_map_merge_of_an_empty_shard_and_deterministic_parts(map_merge, tmp_path):
    """A shard without rows gives an empty part that merges to nothing; a part written twice has the same bytes."""
    x, root = map_merge["x"], map_merge["root"]
    assert add_part(root / "trained.faiss", x, 5000, 5000, tmp_path / "empty.npz") == 0
    add_part(root / "trained.faiss", x, 3000, 10_000, tmp_path / "again.npz", batch_size=999)
    assert (tmp_path / "again.npz").read_bytes() == map_merge["parts"][1].read_bytes()
    parts = [map_merge["parts"][0], tmp_path / "empty.npz", *map_merge["parts"][1:]]
    merge_parts(root / "trained.faiss", parts, tmp_path / "index", on_disk=False)
    assert (tmp_path / "index" / INDEX_FILE).read_bytes() == (root / "single" / INDEX_FILE).read_bytes()
    with pytest.raises(ValueError, match="hold no vectors"):
        merge_parts(root / "trained.faiss", [tmp_path / "empty.npz"], tmp_path / "none")


def test_map_merge_refuses_bad_parts(map_merge, tmp_path):
    x, root = map_merge["x"], map_merge["root"]
    trained = root / "trained.faiss"
    with pytest.raises(FileNotFoundError, match="no trained index"):
        add_part(tmp_path / "missing.faiss", x, 0, 10, tmp_path / "p.npz")
    with pytest.raises(ValueError, match="not within"):
        add_part(trained, x, 100, N + 1, tmp_path / "p.npz")
    with pytest.raises(ValueError, match="dims"):
        add_part(trained, x[:, :16], 0, 10, tmp_path / "p.npz")
    with pytest.raises(FileNotFoundError, match="shard-00009.npz is missing"):
        merge_parts(trained, [root / "parts" / "shard-00009.npz"], tmp_path / "index")
    (tmp_path / "cut.npz").write_bytes(map_merge["parts"][0].read_bytes()[:5000])
    with pytest.raises(ArtifactError, match="not a readable index part"):
        merge_parts(trained, [tmp_path / "cut.npz"], tmp_path / "index")
    other = tmp_path / "other.faiss"
    train_ivfpq(x[:2000], other, nlist=16, **BUILD)
    add_part(other, x, 0, 2000, tmp_path / "other.npz")
    with pytest.raises(ArtifactError, match="16 lists, this index has 512"):
        merge_parts(trained, [tmp_path / "other.npz"], tmp_path / "index")
    assert not (tmp_path / "index" / INDEX_FILE).exists()
