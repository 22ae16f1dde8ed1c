"""The retrieval index for training-data attribution: FAISS IVFPQ over L2-normalized chunk embeddings.

As in the paper, every chunk embedding is compressed to a product-quantization code (``code_bytes`` sub-quantizers of
8 bits, 64 bytes by default) stored in the inverted list of its nearest coarse centroid, and a query scans the
``nprobe`` lists whose centroids have the largest inner product with it. Vectors are unit length, so the inner product
is the cosine similarity (``METRIC_INNER_PRODUCT``). Quality is the paper's self-recall@10: query with 1,000 indexed
chunks at ``nprobe`` 16 and count how often the chunk itself comes back in the top 10 (the paper got 0.968).

FAISS only stores integer ids: row ``i`` of the embedding array gets id ``i``, and the caller keeps the map from row to
``chunk_id`` (the aligned id arrays of ``embeddings.zarr``).

Building reads vectors ``batch_size`` rows at a time from any row-sliceable array (``numpy``, ``np.memmap``, a float16
zarr array), and past :data:`ON_DISK_ABOVE` rows writes the inverted lists to ``invlists.ondisk`` (a FAISS
``OnDiskInvertedLists`` file) merged from part files instead of holding them. Build memory is then one batch, one part
(:data:`PART_ROWS` rows, ~75 MB) and the training sample, which grows only like sqrt(n) (39 rows per list: 250 MB at
1M x 384 dims, ~2 GB at 100M); an in-memory build holds all codes and ids instead of a part (72 bytes a vector at
64-byte codes). Searching memory-maps the lists either way, so a loaded index costs page cache, not heap.

Time grows like n * nlist ~ n^1.5: every vector is compared with every coarse centroid (brute force, BLAS), and the
coarse k-means does the same for the sample. At 1M x 384 on 2 cores that is a few minutes; at 100M it would be many
hours, and an HNSW coarse quantizer (FAISS ``IVF..._HNSW32``) or a GPU would be the next step.

Files in the index folder, each written under a temporary name and renamed into place:

- ``index.faiss``: the index (coarse centroids, PQ codebooks and, unless on disk, the inverted lists);
- ``invlists.ondisk``: the inverted lists of an on-disk index (``index.faiss`` refers to it by name, and
  :func:`load_index` looks for it beside ``index.faiss``, so the folder can be moved).

FAISS is imported inside the functions so that importing this module (and the CLI) stays fast.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

INDEX_FILE = "index.faiss"
INVLISTS_FILE = "invlists.ondisk"

# Above this many vectors build_ivfpq(on_disk=None) writes the inverted lists to disk. An in-memory build holds every
# code and id until the index is written: 72 bytes a vector with 64-byte codes, ~150 MB at 2M. That is still small,
# but the corpus behind a real run has 10-100x more chunks, and the on-disk build needs only one batch in memory.
ON_DISK_ABOVE = 2_000_000

# Rows per part file of an on-disk build (whole batches; see _add_on_disk): 72 MB of codes and ids in memory at most,
# and ~100 parts for 100M rows.
PART_ROWS = 1 << 20

# FAISS warns when k-means gets fewer than 39 training points per centroid: nlist_for keeps n // nlist above that,
# and the default training sample gives each coarse centroid exactly that many (see default_train_size).
MIN_POINTS_PER_CENTROID = 39
TRAIN_MIN = 50_000

PQ_BITS = 8  # bits per sub-quantizer: 256 codewords, one byte of code each
# A row whose norm is further than this from 1 is rejected: float16 storage rounds norms by ~1e-3, while an
# un-normalized embedding (the embedder's bug, not ours to hide) is off by far more.
NORM_TOLERANCE = 0.02

ProgressFn = Callable[[int, int], None]


def nlist_for(n: int) -> int:
    """Number of coarse clusters (inverted lists) for ``n`` vectors: ~4 * sqrt(n), a power of two, >= 39 points each.

    FAISS' guideline for IVF is between 4 * sqrt(n) and 16 * sqrt(n) lists. The low end keeps lists long (~sqrt(n) / 4
    vectors each), so ``nprobe`` 16 scans a fair share of the neighbourhood, and the coarse k-means stays cheap.
    Rounding to the nearest power of two (in log scale) makes the value stable under small changes of ``n``; the cap
    (the largest power of two not above ``n // 39``) keeps at least 39 training points per centroid, the minimum FAISS
    asks for, which decides the value for small ``n``. At least 1.

    Examples: 1,000 -> 16, 20,000 -> 512, 1M -> 4096, 100M -> 32768.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    nlist = 2 ** round(math.log2(4 * math.sqrt(n)))
    cap = n // MIN_POINTS_PER_CENTROID
    if nlist > cap:
        nlist = 2 ** int(math.log2(cap)) if cap >= 1 else 1
    return int(nlist)


def pq_m_for(d: int, code_bytes: int = 64) -> int:
    """Number of PQ sub-quantizers (8 bits each) for ``d`` dims: ``code_bytes``, or the largest divisor of ``d`` below.

    FAISS' product quantizer splits a vector into ``m`` equal sub-vectors, so ``m`` must divide ``d``; with 8-bit
    sub-quantizers the code is ``m`` bytes. Rather than fail on an odd ``d``, take the largest divisor not above the
    byte budget (e.g. d=384 -> 64, d=100 -> 50, d=97 -> 1): the code never grows past the budget.
    """
    if d < 1 or code_bytes < 1:
        raise ValueError(f"d and code_bytes must be at least 1, got d={d}, code_bytes={code_bytes}")
    return max(m for m in range(1, min(code_bytes, d) + 1) if d % m == 0)


def default_train_size(n: int, nlist: int) -> int:
    """Training sample for ``n`` vectors and ``nlist`` lists: max(39 * nlist, 50,000), at most ``n``.

    39 points per coarse centroid is the least FAISS accepts without a warning, and the coarse k-means is most of the
    training time (sample x nlist x d x 10 iterations: ~160k points and ~1.5 minutes for 1M vectors on 2 cores here),
    so the sample stays at that minimum; more points would move the centroids little, and a row's own list is found
    exactly whatever the centroids. The PQ codebooks (256 codewords each) want tens of thousands of points whatever
    ``nlist``, hence the 50,000 floor (FAISS subsamples their training to 65,536 residuals itself).
    """
    return min(n, max(MIN_POINTS_PER_CENTROID * nlist, TRAIN_MIN))


def build_ivfpq(
    vectors: Any,
    folder: str | Path,
    *,
    code_bytes: int = 64,
    nlist: int | None = None,
    train_size: int | None = None,
    batch_size: int = 65536,
    on_disk: bool | None = None,
    seed: int = 0,
    progress: ProgressFn | None = None,
    threads: int | None = None,
) -> dict:
    """Train an IVFPQ index (inner product) on a sample of ``vectors``, add them all, and write it to ``folder``.

    Row ``i`` of ``vectors`` gets id ``i``. Rows are read ``batch_size`` at a time, converted to float32 and
    renormalized (float16 storage rounds norms); a row whose norm is not within 2% of 1 is an error, since
    normalizing is the embedder's job and renormalizing its un-normalized output here would hide a bug.

    Training uses a random sample of rows (drawn with ``seed``, read in row order): :func:`default_train_size` rows
    unless ``train_size`` is given. Coarse k-means and PQ codebooks are seeded too, so the same input, arguments and
    FAISS build give the same index (FAISS' multi-threaded k-means does not depend on the thread count). With fewer
    than 256 rows the sample is repeated up to 256, the least FAISS' 8-bit k-means accepts; the codebooks then simply
    memorize the data.

    In memory (``on_disk`` False) every batch is added to one index written as ``index.faiss``. On disk, the batches'
    inverted lists go to part files of up to :data:`PART_ROWS` rows in a build folder, and the parts are merged into
    one ``invlists.ondisk`` (``OnDiskInvertedLists.merge_from_multiple``, as in ``faiss.contrib.ondisk.merge_ondisk``),
    so memory holds one batch and one part at a time; disk briefly holds the lists twice. ``on_disk=None`` picks on
    disk above :data:`ON_DISK_ABOVE` rows. Both give the same search results (the same codes in the same lists).

    The build happens in ``folder/.build-<pid>/``; ``index.faiss`` is renamed into place last, after any old one was
    removed, so the folder holds either the old index, no index, or the new one, never a mix.

    Args:
        vectors: ``(n, d)`` array-like of L2-normalized embeddings supporting ``vectors[a:b]`` (and, for the training
            sample, integer-array or zarr orthogonal indexing; otherwise the sample is read batch by batch).
        folder: Output folder, created if needed.
        code_bytes: PQ code size budget in bytes; see :func:`pq_m_for`.
        nlist: Number of inverted lists; default :func:`nlist_for` ``(n)``.
        train_size: Training sample size; default :func:`default_train_size`.
        batch_size: Rows read and encoded at a time.
        on_disk: Write the inverted lists to ``invlists.ondisk``; None: when ``n > ON_DISK_ABOVE``.
        seed: Seed of the training sample and of the k-means runs.
        progress: Called as ``progress(rows_added, n)`` after each batch.
        threads: OpenMP threads for FAISS during the build (restored afterwards); None leaves FAISS' setting alone.

    Returns:
        Build statistics: ``n``, ``d``, ``nlist``, ``m`` (sub-quantizers), ``code_bytes`` (bytes per code, = ``m``),
        ``train_size``, ``on_disk``, ``files`` (names in ``folder``), ``bytes`` (their total size),
        ``bytes_per_vector``, ``train_seconds``, ``add_seconds`` (reading, encoding, writing and merging).

    Raises:
        ValueError: On an empty or non 2-D input, bad arguments, or rows that are not unit length.
    """
    import faiss

    n, d = _shape(vectors)
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    nlist = nlist_for(n) if nlist is None else int(nlist)
    if not 1 <= nlist <= n:
        raise ValueError(f"nlist must be between 1 and n={n}, got {nlist}")
    train_size = default_train_size(n, nlist) if train_size is None else min(int(train_size), n)
    if train_size < nlist:
        raise ValueError(f"train_size ({train_size}) must be at least nlist ({nlist}): k-means needs a point per list")
    m = pq_m_for(d, code_bytes)
    on_disk = n > ON_DISK_ABOVE if on_disk is None else bool(on_disk)

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    build_dir = folder / f".build-{os.getpid()}"
    shutil.rmtree(build_dir, ignore_errors=True)
    build_dir.mkdir()
    try:
        with _omp_threads(threads):
            start = time.perf_counter()
            index = _train(vectors, n, d, nlist, m, train_size, batch_size, seed)
            train_seconds = time.perf_counter() - start

            start = time.perf_counter()
            if on_disk:
                _add_on_disk(index, vectors, n, batch_size, build_dir, folder, progress)
            else:
                _add_in_memory(index, vectors, n, batch_size, progress)
            faiss.write_index(index, str(build_dir / INDEX_FILE))
            code_size = int(index.code_size)
            del index  # closes the on-disk lists' memory map before the file is moved
            _publish(build_dir, folder, on_disk)
            add_seconds = time.perf_counter() - start
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)

    files = [INDEX_FILE, INVLISTS_FILE] if on_disk else [INDEX_FILE]
    size = sum((folder / name).stat().st_size for name in files)
    return {
        "n": n, "d": d, "nlist": nlist, "m": m, "code_bytes": code_size, "train_size": train_size,
        "on_disk": on_disk, "files": files, "bytes": size, "bytes_per_vector": size / n,
        "train_seconds": round(train_seconds, 3), "add_seconds": round(add_seconds, 3),
    }


def load_index(folder: str | Path, nprobe: int = 16, mmap: bool = True):
    """Read the index that :func:`build_ivfpq` wrote to ``folder`` and set its ``nprobe``.

    With ``mmap`` the inverted lists of an in-memory index are memory-mapped from ``index.faiss``
    (``IO_FLAG_MMAP``) instead of read into the heap: opening is instant and the OS pages in what queries touch.
    The lists of an on-disk index are always memory-mapped, from the ``invlists.ondisk`` beside ``index.faiss``
    (``IO_FLAG_ONDISK_SAME_DIR``: the path stored in the file is ignored, so a moved or copied folder still works),
    read-only. The index is for searching: adding to it is not supported.

    Raises:
        FileNotFoundError: If ``folder/index.faiss`` (or the ``invlists.ondisk`` it needs) does not exist.
        atlas.core.files.ArtifactError: If ``index.faiss`` cannot be read (truncated or damaged).
    """
    import faiss

    folder = Path(folder)
    path = folder / INDEX_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no index at {path} ({'folder exists' if folder.is_dir() else 'folder is missing'}):"
                                " build one with atlas.models.ivfpq.build_ivfpq")
    # The flags depend on the layout, and build_ivfpq leaves invlists.ondisk exactly when the index uses it. They
    # cannot be the same for both: IO_FLAG_MMAP includes IO_FLAG_SKIP_IVF_DATA, which for on-disk lists means "do not
    # open them" (searching such an index crashes), and on-disk lists are memory-mapped anyway.
    try:
        if (folder / INVLISTS_FILE).is_file():
            with _stdout_to_stderr():  # FAISS prints the SAME_DIR path rewrite on stdout
                index = faiss.read_index(str(path), faiss.IO_FLAG_ONDISK_SAME_DIR | faiss.IO_FLAG_READ_ONLY)
        else:
            index = faiss.read_index(str(path), faiss.IO_FLAG_MMAP if mmap else 0)
    except RuntimeError as e:  # FAISS reports a cut or foreign file as an assertion deep inside its reader
        from atlas.core.files import ArtifactError

        detail = str(e).strip().splitlines()[-1]
        raise ArtifactError(f"{path}: not a readable FAISS index ({detail}): truncated or damaged; rebuild it "
                            "(atlas run CONFIG --force --stages index)") from None
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        lists = faiss.downcast_InvertedLists(ivf.invlists)
        # Lists read through IO_FLAG_MMAP come back as nameless OnDiskInvertedLists; a name means the index wanted
        # an invlists.ondisk that is not there, and FAISS skipped opening it.
        if isinstance(lists, faiss.OnDiskInvertedLists) and lists.filename and not (folder / INVLISTS_FILE).is_file():
            raise FileNotFoundError(f"{path} keeps its inverted lists in {INVLISTS_FILE}, which is missing from "
                                    f"{folder}")
        ivf.nprobe = int(nprobe)
    return index


def search(
    index: Any,
    queries: Any,
    k: int = 10,
    *,
    nprobe: int | None = None,
    rerank: int = 0,
    vectors: Any = None,
    batch_size: int = 1024,
    threads: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` indexed rows most similar (inner product) to each query.

    Queries are converted to float32 and normalized, so scores are cosine similarities (PQ estimates of them unless
    re-ranked); a zero or non-finite query is an error. Where fewer than ``k`` vectors sit in the probed lists,
    the missing places have row -1 and score -inf.

    Re-ranking (``rerank`` > ``k``) takes the ``rerank`` best candidates by PQ score, reads their stored vectors
    from ``vectors`` (the array the index was built from; rows are read sorted and deduplicated per batch of
    queries) and orders them by their exact inner product with the query. It fixes ranking errors of the 64-byte
    codes among close candidates, at the price of ``rerank`` random row reads per query: cheap from a
    ``np.memmap`` in page cache, slow from a compressed zarr array (whole chunks are decoded).

    Args:
        index: From :func:`load_index` (or any FAISS index with inner-product scores).
        queries: ``(q, d)`` or ``(d,)`` embeddings.
        k: Results per query.
        nprobe: Lists to scan for this call (passed as search parameters: the index is not changed); None: the
            index's own ``nprobe``.
        rerank: Candidates to re-score exactly; 0 (or <= ``k``) for none.
        vectors: The indexed embeddings, required when re-ranking.
        batch_size: Queries per FAISS call.
        threads: OpenMP threads for FAISS during the call (restored afterwards); None leaves FAISS' setting alone.

    Returns:
        ``(scores, rows)``: float32 and int64 arrays of shape ``(q, k)``, best first.
    """
    import faiss

    q = _as_queries(queries, index.d)
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    rerank = int(rerank) if rerank and rerank > k else 0
    if rerank and vectors is None:
        raise ValueError("rerank needs the indexed vectors (vectors=...)")
    fetch = rerank or k
    params = None
    if nprobe is not None:
        if not isinstance(index, faiss.IndexIVF):
            raise ValueError("nprobe= needs a plain IVF index (for a wrapped one, set it on the index)")
        params = faiss.SearchParametersIVF(nprobe=int(nprobe))

    scores = np.empty((len(q), k), dtype=np.float32)
    rows = np.empty((len(q), k), dtype=np.int64)
    with _omp_threads(threads):
        for start in range(0, len(q), batch_size):
            batch = q[start:start + batch_size]
            s, r = index.search(batch, fetch, params=params) if params is not None else index.search(batch, fetch)
            if rerank:
                s, r = _rerank(batch, r, vectors, k)
            r = r.astype(np.int64, copy=False)
            s = np.where(r >= 0, s, -np.inf).astype(np.float32, copy=False)
            scores[start:start + len(batch)] = s[:, :k]
            rows[start:start + len(batch)] = r[:, :k]
    return scores, rows


def self_recall(index: Any, vectors: Any, sample: int = 1000, k: int = 10, nprobe: int = 16, seed: int = 0, *,
                rerank: int = 0, threads: int | None = None) -> float:
    """The paper's recall@k: the share of ``sample`` indexed rows that find themselves among their top ``k``.

    Rows are drawn at random (with ``seed``) from the first ``index.ntotal`` rows of ``vectors``, which must be the
    array the index was built from (row i = id i), and searched with ``nprobe`` lists (ignored by non-IVF indexes,
    e.g. an exact ``IndexFlatIP`` baseline). A row's own list is always probed (it was added to its nearest
    centroid), so misses come from the PQ codes ranking it below ``k`` others, or from exact or near duplicates
    outscoring it: even an exact index misses a row that has ``k`` or more exact duplicates.
    """
    import faiss

    n = int(index.ntotal)
    if n == 0:
        raise ValueError("the index is empty")
    rows = np.sort(np.random.default_rng(seed).choice(n, size=min(sample, n), replace=False))
    queries = _read_rows(vectors, rows)
    nprobe = nprobe if isinstance(index, faiss.IndexIVF) else None
    _, found = search(index, queries, k, nprobe=nprobe, rerank=rerank, vectors=vectors, threads=threads)
    return float(np.mean((found == rows[:, None]).any(axis=1)))


# ---------------------------------------------------------------------------------------------------------------------


def _shape(vectors: Any) -> tuple[int, int]:
    shape = tuple(getattr(vectors, "shape", ()))
    if len(shape) != 2 or shape[0] == 0 or shape[1] == 0:
        raise ValueError(f"expected a non-empty (n, d) array of embeddings, got shape {shape}")
    return int(shape[0]), int(shape[1])


def _unit_rows(x: Any, first_row: int | np.ndarray) -> np.ndarray:
    """``x`` as float32 with rows renormalized; rows whose norm is not within NORM_TOLERANCE of 1 are an error.

    ``first_row`` (the row number of ``x[0]``, or the array of row numbers) only serves the error message.
    """
    x = np.array(x, dtype=np.float32, copy=True, order="C")
    norms = np.linalg.norm(x, axis=1)
    bad = np.flatnonzero(~(np.abs(norms - 1) <= NORM_TOLERANCE))  # ~(<=) also catches NaN
    if len(bad):
        i = int(bad[0])
        row = int(first_row[i]) if isinstance(first_row, np.ndarray) else first_row + i
        raise ValueError(f"row {row} has norm {norms[i]:.4g}, and {len(bad) - 1} more rows in its batch are not "
                         f"unit length (tolerance {NORM_TOLERANCE}): the index expects L2-normalized embeddings")
    x /= norms[:, None]
    return x


def _as_queries(queries: Any, d: int) -> np.ndarray:
    q = np.array(queries, dtype=np.float32, copy=True, order="C", ndmin=2)
    if q.ndim != 2 or q.shape[1] != d:
        raise ValueError(f"queries must have shape (q, {d}), got {np.shape(queries)}")
    norms = np.linalg.norm(q, axis=1)
    if not np.all(np.isfinite(norms) & (norms > 0)):
        raise ValueError("queries must be finite and non-zero")
    q /= norms[:, None]
    return q


def _read_rows(vectors: Any, rows: np.ndarray) -> np.ndarray:
    """Rows ``rows`` (sorted, unique) of ``vectors``, in that order, as they are stored (not converted)."""
    if isinstance(vectors, np.ndarray):  # np.memmap too: reads only the pages it needs
        return vectors[rows]
    if hasattr(vectors, "get_orthogonal_selection"):  # zarr: decodes each chunk it needs once
        return np.asarray(vectors.get_orthogonal_selection((rows, slice(None))))
    try:
        return np.asarray(vectors[rows])
    except Exception:  # an array-like that only slices: walk the rows in contiguous runs
        parts, i = [], 0
        while i < len(rows):
            j = i
            while j + 1 < len(rows) and rows[j + 1] == rows[j] + 1:
                j += 1
            parts.append(np.asarray(vectors[int(rows[i]):int(rows[j]) + 1]))
            i = j + 1
        return np.concatenate(parts)


def _rerank(queries: np.ndarray, candidates: np.ndarray, vectors: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best of each query's ``candidates`` by exact inner product with their stored vectors."""
    valid = candidates >= 0
    unique = np.unique(candidates[valid])
    if len(unique) == 0:
        return np.full(candidates.shape, -np.inf, np.float32), candidates
    stored = _unit_rows(_read_rows(vectors, unique), unique)
    position = np.searchsorted(unique, np.where(valid, candidates, unique[0]))
    exact = np.empty(candidates.shape, dtype=np.float32)
    step = 64  # queries per product: bounds the (step, candidates, d) temporary to a few MB
    for start in range(0, len(queries), step):
        block = slice(start, start + step)
        exact[block] = np.matmul(stored[position[block]], queries[block, :, None])[:, :, 0]
    exact[~valid] = -np.inf
    order = np.argsort(-exact, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(exact, order, axis=1), np.take_along_axis(candidates, order, axis=1)


def _batches(vectors: Any, n: int, batch_size: int) -> Iterator[tuple[int, np.ndarray]]:
    for start in range(0, n, batch_size):
        yield start, _unit_rows(vectors[start:min(n, start + batch_size)], start)


def _train(vectors: Any, n: int, d: int, nlist: int, m: int, train_size: int, batch_size: int, seed: int):
    import faiss

    rows = np.sort(np.random.default_rng(seed).choice(n, size=train_size, replace=False))
    sample = np.empty((len(rows), d), dtype=np.float32)  # filled in place: one copy of the sample, not two
    for start in range(0, len(rows), batch_size):
        part = rows[start:start + batch_size]
        sample[start:start + len(part)] = _unit_rows(_read_rows(vectors, part), part)
    ksub = 2 ** PQ_BITS
    if len(sample) < ksub:  # FAISS' k-means refuses fewer points than centroids
        sample = np.resize(sample, (ksub, d))
    # "np": no polysemous training. The factory turns it on by default; it reorders codewords for Hamming-distance
    # filtering, which this index does not use, and costs more than the whole k-means (minutes at 64 bytes).
    index = faiss.index_factory(d, f"IVF{nlist},PQ{m}x{PQ_BITS}np", faiss.METRIC_INNER_PRODUCT)
    index.cp.seed = seed
    index.pq.cp.seed = seed
    # Below 39 * 256 = 9,984 residuals FAISS warns once per sub-quantizer (64 lines); the codebooks are then finer
    # than the data needs, which costs nothing at search time.
    index.pq.cp.min_points_per_centroid = 1
    index.train(sample)
    return index


class _Encoder:
    """Encodes vectors exactly as ``IndexIVFPQ.sa_encode`` does (list number + PQ code), several times faster.

    FAISS' default encoder has fast kernels for some sub-vector sizes only (4 and 8 dims were fast here, 6 and 12
    were not); 384 dims in 64 sub-quantizers gives 6, and encoding then dominated the build (~9 s per 65,536 vectors
    here, against ~1.4 s through the BLAS path below). The BLAS path is FAISS' own
    ``compute_codes_with_assign_index`` (nearest codeword by an ``IndexFlatL2`` search per sub-quantizer), and the
    residuals and list numbers are computed as ``IndexIVFPQ`` computes them, so the codes are the same (the tests
    compare them with ``sa_encode``); ``add_sa_codes`` then stores them where ``add_with_ids`` would.
    """

    def __init__(self, index) -> None:
        import faiss

        self.ivf = faiss.downcast_index(faiss.extract_index_ivf(index))
        self.centroids = self.ivf.quantizer.reconstruct_n(0, self.ivf.nlist)
        self.assign_index = faiss.IndexFlatL2(self.ivf.pq.dsub)
        self.listno_bytes = self.ivf.coarse_code_size()

    def __call__(self, x: np.ndarray) -> np.ndarray:
        import faiss

        _, lists = self.ivf.quantizer.search(x, 1)
        lists = lists[:, 0]
        residuals = np.ascontiguousarray(x - self.centroids[lists]) if self.ivf.by_residual else x
        codes = np.empty((len(x), self.listno_bytes + self.ivf.pq.code_size), dtype=np.uint8)
        pq_codes = np.empty((len(x), self.ivf.pq.code_size), dtype=np.uint8)
        pq = self.ivf.pq
        pq.assign_index = self.assign_index  # a borrowed pointer: reset before anything copies or frees the PQ
        try:
            pq.compute_codes_with_assign_index(faiss.swig_ptr(residuals), faiss.swig_ptr(pq_codes), len(x))
        finally:
            pq.assign_index = None
        # FAISS' encode_listno: the list number in the first coarse_code_size() bytes, little-endian.
        codes[:, :self.listno_bytes] = lists.astype("<i8").view(np.uint8).reshape(-1, 8)[:, :self.listno_bytes]
        codes[:, self.listno_bytes:] = pq_codes
        return codes


def _add_in_memory(index, vectors: Any, n: int, batch_size: int, progress: ProgressFn | None) -> None:
    encode = _Encoder(index)
    for start, x in _batches(vectors, n, batch_size):
        index.add_sa_codes(encode(x), np.arange(start, start + len(x), dtype=np.int64))
        if progress is not None:
            progress(start + len(x), n)


def _add_on_disk(index, vectors: Any, n: int, batch_size: int, build_dir: Path, folder: Path,
                 progress: ProgressFn | None) -> None:
    """Encode the batches into part files of inverted lists, then merge the parts into ``build_dir/invlists.ondisk``.

    The plan of ``faiss.contrib.ondisk.merge_ondisk``, done differently in three ways:

    - A part holds only lists (codes and ids), as an ``OnDiskInvertedLists`` file; a partial index would also store
      the coarse centroids, nlist * d * 4 bytes per part (6 MB at 1M rows, 50 MB at 100M).
    - A part gathers batches up to ``PART_ROWS`` rows (at least one batch): each part keeps nlist * 24 bytes of list
      metadata in memory until the merge, which per 65,536-row batch would be 1.2 GB over a 100M-row build.
    - The parts are made by the ``OnDiskInvertedLists`` constructor and freed after the merge. merge_ondisk reads
      partial indexes back with ``IO_FLAG_MMAP`` and never frees their lists: freeing those (read-only, mapped)
      lists from Python corrupted the heap in our tries, which is presumably why it leaks them on purpose.
    """
    import faiss

    ivf = faiss.extract_index_ivf(index)
    encode = _Encoder(index)
    parts = []  # OnDiskInvertedLists, one per part file, owned by Python

    def fresh_lists():
        lists = faiss.ArrayInvertedLists(ivf.nlist, ivf.code_size)
        ivf.replace_invlists(lists, False)  # the index writes into them; Python owns them
        return lists

    def write_part(lists) -> None:
        part = faiss.OnDiskInvertedLists(ivf.nlist, ivf.code_size, str(build_dir / f"part-{len(parts):06d}.ivfdata"))
        _merge_lists(part, [lists])
        parts.append(part)

    lists, rows_in_part = fresh_lists(), 0
    for start, x in _batches(vectors, n, batch_size):
        index.add_sa_codes(encode(x), np.arange(start, start + len(x), dtype=np.int64))
        rows_in_part += len(x)
        if rows_in_part >= PART_ROWS:
            write_part(lists)
            lists, rows_in_part = fresh_lists(), 0
        if progress is not None:
            progress(start + len(x), n)
    if rows_in_part:
        write_part(lists)

    invlists = faiss.OnDiskInvertedLists(ivf.nlist, ivf.code_size, str(build_dir / INVLISTS_FILE))
    ntotal = _merge_lists(invlists, parts)
    # The path written into index.faiss: where the file will be once published (load_index ignores it anyway).
    invlists.filename = str((folder / INVLISTS_FILE).absolute())
    ivf.replace_invlists(invlists, True)
    invlists.this.disown()  # the index owns it now
    index.ntotal = ivf.ntotal = ntotal
    del lists
    parts.clear()  # unmaps the parts
    for path in build_dir.glob("part-*.ivfdata"):
        path.unlink()


def _merge_lists(target, sources: list) -> int:
    """Merge ``sources`` (inverted lists) into the empty on-disk ``target``, list by list in order; the entry count."""
    import faiss

    pointers = faiss.InvertedListsPtrVector()
    for source in sources:
        pointers.push_back(source)
    with _stdout_to_stderr():  # FAISS prints "resizing <file>" on stdout
        return int(target.merge_from_multiple(pointers.data(), pointers.size(), False))


def _publish(build_dir: Path, folder: Path, on_disk: bool) -> None:
    """Move the built files into ``folder``: the old index disappears first and ``index.faiss`` arrives last."""
    for name in ([INVLISTS_FILE] if on_disk else []) + [INDEX_FILE]:
        _fsync(build_dir / name)
    (folder / INDEX_FILE).unlink(missing_ok=True)
    if on_disk:
        os.replace(build_dir / INVLISTS_FILE, folder / INVLISTS_FILE)
    os.replace(build_dir / INDEX_FILE, folder / INDEX_FILE)
    if not on_disk:
        (folder / INVLISTS_FILE).unlink(missing_ok=True)  # left by an earlier on-disk build
    _fsync(folder)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send what C code prints on stdout to stderr for the duration (FAISS' on-disk lists print progress notes).

    Callers of the CLI may parse its stdout. This swaps file descriptor 1 for the whole process, so Python output
    from other threads in that window goes to stderr too; the windows are a merge and a file open.
    """
    import ctypes

    sys.stdout.flush()
    libc = ctypes.CDLL(None)
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        libc.fflush(None)  # C stdio buffers what FAISS printed: out with it before fd 1 is restored
        os.dup2(saved, 1)
        os.close(saved)


@contextlib.contextmanager
def _omp_threads(threads: int | None) -> Iterator[None]:
    """Run the block with FAISS' OpenMP pool at ``threads`` (then restore it); do nothing when ``threads`` is None."""
    if threads is None:
        yield
        return
    import faiss

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(int(threads))
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)
