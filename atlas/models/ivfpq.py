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

The same index can be built as map + merge, the row ranges on any workers (the ``index`` stage does it per annotate
shard): :func:`train_ivfpq` trains the empty index once, on a seeded sample of all the rows, and writes it;
:func:`add_part` encodes a range of rows with it into a part file of inverted lists (ids = row numbers);
:func:`merge_parts` merges the parts, in the order given, into the index. Training, encoding and merging are
:func:`build_ivfpq`'s own, and every row is encoded by the same FAISS kernel whatever range it is in (see
``_Encoder.encode``), so parts of consecutive ranges merged in row order give build_ivfpq's index, byte for byte.

Time grows like n * nlist ~ n^1.5: every vector is compared with every coarse centroid (brute force, BLAS), and the
coarse k-means does the same for the sample. At 1M x 384 on 2 cores that is a few minutes; at 100M it would be many
hours, and an HNSW coarse quantizer (FAISS ``IVF..._HNSW32``) or a GPU would be the next step.

Files in the index folder, each written under a temporary name and renamed into place:

- ``index.faiss``: the index (coarse centroids, PQ codebooks and, unless on disk, the inverted lists);
- ``invlists.ondisk``: the inverted lists of an on-disk index (``index.faiss`` refers to it by name, and
  :func:`load_index` looks for it beside ``index.faiss``, so the folder can be moved).

A map + merge build also has the trained index and the parts, wherever the caller puts them (see :func:`add_part`
for the part format).

FAISS is imported inside the functions so that importing this module (and the CLI) stays fast.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import sys
import time
import zipfile
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

# Rows per part file of an on-disk build (whole batches; see _write_parts): 72 MB of codes and ids in memory at most,
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

    In memory (``on_disk`` False) every batch is added to one index written as ``index.faiss``. On disk, the rows are
    encoded into part files of up to :data:`PART_ROWS` rows in a build folder and the parts are merged into one
    ``invlists.ondisk``, as :func:`merge_parts` merges the parts of a map + merge build, so memory holds one batch and
    one part at a time; disk briefly holds the lists twice. ``on_disk=None`` picks on disk above
    :data:`ON_DISK_ABOVE` rows. Both give the same search results (the same codes in the same lists).

    The build happens in ``folder/.build/``; ``index.faiss`` is renamed into place last, after any old one was
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
    nlist, train_size, m = _sizes(n, d, code_bytes, nlist, train_size, batch_size)
    on_disk = n > ON_DISK_ABOVE if on_disk is None else bool(on_disk)

    folder = Path(folder)
    build_dir = _fresh_build_dir(folder)
    try:
        with _omp_threads(threads):
            start = time.perf_counter()
            index = _train(vectors, n, d, nlist, m, train_size, batch_size, seed)
            train_seconds = time.perf_counter() - start

            start = time.perf_counter()
            if on_disk:
                parts = _write_parts(index, vectors, n, batch_size, build_dir, progress)
                _merge_parts(index, parts, _list_sizes(parts, nlist), build_dir, folder, on_disk=True)
                for path in parts:
                    path.unlink()
            else:
                _add_in_memory(index, vectors, n, batch_size, progress)
            faiss.write_index(index, str(build_dir / INDEX_FILE))
            facts = _facts(index)
            del index  # closes the on-disk lists' memory map before the file is moved
            _publish(build_dir, folder, on_disk)
            add_seconds = time.perf_counter() - start
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    return facts | _files(folder, on_disk, n) | {
        "train_size": train_size, "train_seconds": round(train_seconds, 3), "add_seconds": round(add_seconds, 3)}


# --- map + merge: train once, encode row ranges anywhere, merge their inverted lists ---------------------------------


def train_ivfpq(
    vectors: Any,
    path: str | Path,
    *,
    code_bytes: int = 64,
    nlist: int | None = None,
    train_size: int | None = None,
    batch_size: int = 65536,
    seed: int = 0,
    threads: int | None = None,
) -> dict:
    """Train an empty IVFPQ index on a sample of all of ``vectors`` and write it to ``path``: map + merge, step 1.

    The training is :func:`build_ivfpq`'s, with the same arguments, defaults and seeds, so that the parts
    :func:`add_part` encodes with this index and :func:`merge_parts` merges make the index build_ivfpq makes. The
    file holds the coarse centroids and PQ codebooks (nlist x d x 4 bytes and 256 x d x 4 bytes), no vectors; it is
    written under a temporary name and renamed into place.

    Returns:
        ``n``, ``d``, ``nlist``, ``m``, ``code_bytes``, ``train_size``, ``train_seconds``.

    Raises:
        ValueError: As build_ivfpq.
    """
    n, d = _shape(vectors)
    nlist, train_size, m = _sizes(n, d, code_bytes, nlist, train_size, batch_size)
    start = time.perf_counter()
    with _omp_threads(threads):
        index = _train(vectors, n, d, nlist, m, train_size, batch_size, seed)
    train_seconds = time.perf_counter() - start
    _write_index_atomically(index, Path(path))
    return _facts(index) | {"n": n, "train_size": train_size, "train_seconds": round(train_seconds, 3)}


def add_part(
    trained: str | Path,
    vectors: Any,
    start: int,
    end: int,
    path: str | Path,
    *,
    batch_size: int = 65536,
    threads: int | None = None,
) -> int:
    """Encode rows ``start`` to ``end`` (excluded) of ``vectors`` with the index :func:`train_ivfpq` wrote to
    ``trained``, and write their inverted lists to the part file ``path``: map + merge, step 2 (any worker).

    Row ``i`` gets id ``i``, the row's number in all of ``vectors``. Rows are read and checked ``batch_size`` at a
    time, as in :func:`build_ivfpq`; the part's codes and ids are held until it is written, 72 bytes a row at 64-byte
    codes (7 MB for 100,000 rows). The part is an uncompressed ``.npz`` (numpy's zip of arrays): ``list_sizes``
    (int64, one per list), ``ids`` (int64) and ``codes`` (uint8, ``code_bytes`` per row) of its rows, grouped by list
    in list order and in row order within a list. It is written under a temporary name and renamed into place, so a
    rerun after a kill writes it again, byte for byte.

    Returns:
        The number of rows encoded.

    Raises:
        FileNotFoundError: If there is no trained index at ``trained``.
        ValueError: On a row range outside ``vectors``, vectors of another dimension, or rows that are not unit
            length.
    """
    n, d = _shape(vectors)
    index = _read_trained(trained)
    if index.d != d:
        raise ValueError(f"{trained} indexes {index.d}-dim vectors, these have {d} dims")
    if not 0 <= start <= end <= n:
        raise ValueError(f"rows {start}..{end} are not within the {n} rows of vectors")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    with _omp_threads(threads):
        _write_part(Path(path), *_encode_rows(_Encoder(index), vectors, start, end, batch_size))
    return end - start


def merge_parts(
    trained: str | Path,
    parts: list[str | Path],
    folder: str | Path,
    *,
    on_disk: bool | None = None,
) -> dict:
    """Merge the part files ``parts`` (from :func:`add_part`, with the index at ``trained``) into the index in
    ``folder``: map + merge, step 3. List by list, the parts' entries follow each other in the order of ``parts``.

    Parts of consecutive row ranges, given in row order, hold the same codes as :func:`build_ivfpq` makes from the
    same rows, and the merge puts them in the same lists in the same order: the merged index is the index
    build_ivfpq makes in one process (the tests compare the two). The lists are sized first from the parts'
    ``list_sizes``, then each part is read once and copied to its place. In memory (``on_disk`` False) the index
    holds every list (72 bytes a vector at 64-byte codes); on disk the lists are filled in place in
    ``invlists.ondisk``, laid out as FAISS' ``OnDiskInvertedLists.merge_from_multiple`` lays them out (the merge of
    ``faiss.contrib.ondisk.merge_ondisk``), and memory holds one part at a time. ``on_disk=None`` picks on disk above
    :data:`ON_DISK_ABOVE` vectors. The folder is written as build_ivfpq writes it: in ``folder/.build/``, then
    ``index.faiss`` renamed into place last. The parts are left alone.

    Returns:
        ``n``, ``d``, ``nlist``, ``m``, ``code_bytes``, ``parts`` (how many), ``on_disk``, ``files``, ``bytes``,
        ``bytes_per_vector``, ``merge_seconds``.

    Raises:
        FileNotFoundError: If the trained index or a part is missing.
        ValueError: If the parts hold no vectors.
        atlas.core.files.ArtifactError: If a part is damaged or was made with another index.
    """
    import faiss

    start = time.perf_counter()
    folder, parts = Path(folder), [Path(p) for p in parts]
    index = _read_trained(trained)
    sizes = _list_sizes(parts, faiss.extract_index_ivf(index).nlist)
    n = int(sizes.sum())
    if n == 0:
        raise ValueError(f"nothing to merge: the {len(parts)} part(s) hold no vectors")
    on_disk = n > ON_DISK_ABOVE if on_disk is None else bool(on_disk)
    build_dir = _fresh_build_dir(folder)
    try:
        _merge_parts(index, parts, sizes, build_dir, folder, on_disk)
        faiss.write_index(index, str(build_dir / INDEX_FILE))
        facts = _facts(index)
        del index  # closes the on-disk lists' memory map before the file is moved
        _publish(build_dir, folder, on_disk)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    return facts | _files(folder, on_disk, n) | {
        "parts": len(parts), "merge_seconds": round(time.perf_counter() - start, 3)}


def load_index(folder: str | Path, nprobe: int = 16, mmap: bool = True):
    """Read the index that :func:`build_ivfpq` or :func:`merge_parts` wrote to ``folder`` and set its ``nprobe``.

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


def _batches(vectors: Any, start: int, end: int, batch_size: int) -> Iterator[tuple[int, np.ndarray]]:
    for first in range(start, end, batch_size):
        yield first, _unit_rows(vectors[first:min(end, first + batch_size)], first)


def _sizes(n: int, d: int, code_bytes: int, nlist: int | None, train_size: int | None,
           batch_size: int) -> tuple[int, int, int]:
    """``nlist``, ``train_size`` and ``m`` for ``n`` rows of ``d`` dims (None: the documented defaults), checked."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    nlist = nlist_for(n) if nlist is None else int(nlist)
    if not 1 <= nlist <= n:
        raise ValueError(f"nlist must be between 1 and n={n}, got {nlist}")
    train_size = default_train_size(n, nlist) if train_size is None else min(int(train_size), n)
    if train_size < nlist:
        raise ValueError(f"train_size ({train_size}) must be at least nlist ({nlist}): k-means needs a point per list")
    return nlist, train_size, pq_m_for(d, code_bytes)


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


def _read_trained(path: str | Path):
    """The empty trained index :func:`train_ivfpq` wrote to ``path``."""
    import faiss

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no trained index at {path}: train one with atlas.models.ivfpq.train_ivfpq")
    index = faiss.read_index(str(path))
    if not index.is_trained or index.ntotal != 0:
        raise ValueError(f"{path}: not an empty trained index ({index.ntotal} vectors, trained: {index.is_trained})")
    return index


class _Encoder:
    """Encodes vectors as ``IndexIVFPQ.sa_encode`` does (list number + PQ code), several times faster.

    FAISS' default encoder has fast kernels for some sub-vector sizes only (4 and 8 dims were fast here, 6 and 12
    were not); 384 dims in 64 sub-quantizers gives 6, and encoding then dominated the build (~9 s per 65,536 vectors
    here, against ~1.4 s through the BLAS path below). The BLAS path is FAISS' own
    ``compute_codes_with_assign_index`` (nearest codeword by an ``IndexFlatL2`` search per sub-quantizer), and the
    residuals and list numbers are computed as ``IndexIVFPQ`` computes them, so the codes are the same (the tests
    compare them with ``sa_encode``), but for a rare near tie that FAISS' kernels round differently (see
    :meth:`encode`); ``add_sa_codes`` then stores them where ``add_with_ids`` would.
    """

    def __init__(self, index) -> None:
        import faiss

        self.index = index  # self.ivf is a view into it, not a reference that keeps it alive
        self.ivf = faiss.downcast_index(faiss.extract_index_ivf(index))
        self.centroids = self.ivf.quantizer.reconstruct_n(0, self.ivf.nlist)
        self.assign_index = faiss.IndexFlatL2(self.ivf.pq.dsub)
        self.listno_bytes = self.ivf.coarse_code_size()

    def encode(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The list number (int64) and the PQ code (``pq.code_size`` bytes) of each row of ``x``.

        FAISS picks its nearest-codeword kernel by batch size: below ``distance_compute_blas_threshold`` values (rows
        x sub-vector dims, ~21,000 rows at 6 dims) a row-by-row loop, 3-8x slower here for 6 dims, which can round a
        near tie the other way. A shorter batch is padded up to that size (with copies of its first row), so every row
        is encoded by the same kernel whatever batch, part or shard it is in: a shard's codes are those of the
        one-process build, byte for byte, and a small shard is encoded at full speed.
        """
        import faiss

        n = len(x)
        short = -(-faiss.cvar.distance_compute_blas_threshold // self.ivf.pq.dsub) - n
        if short > 0:
            x = np.concatenate([x, np.repeat(x[:1], short, axis=0)])
        _, lists = self.ivf.quantizer.search(x, 1)
        lists = lists[:, 0]
        residuals = np.ascontiguousarray(x - self.centroids[lists]) if self.ivf.by_residual else x
        pq_codes = np.empty((len(x), self.ivf.pq.code_size), dtype=np.uint8)
        pq = self.ivf.pq
        pq.assign_index = self.assign_index  # a borrowed pointer: reset before anything copies or frees the PQ
        try:
            pq.compute_codes_with_assign_index(faiss.swig_ptr(residuals), faiss.swig_ptr(pq_codes), len(x))
        finally:
            pq.assign_index = None
        return lists[:n], pq_codes[:n]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """The codes as ``sa_encode`` gives them, for ``add_sa_codes``: the list number, then the PQ code."""
        lists, pq_codes = self.encode(x)
        codes = np.empty((len(x), self.listno_bytes + pq_codes.shape[1]), dtype=np.uint8)
        # FAISS' encode_listno: the list number in the first coarse_code_size() bytes, little-endian.
        codes[:, :self.listno_bytes] = lists.astype("<i8").view(np.uint8).reshape(-1, 8)[:, :self.listno_bytes]
        codes[:, self.listno_bytes:] = pq_codes
        return codes


def _add_in_memory(index, vectors: Any, n: int, batch_size: int, progress: ProgressFn | None) -> None:
    encode = _Encoder(index)
    for start, x in _batches(vectors, 0, n, batch_size):
        index.add_sa_codes(encode(x), np.arange(start, start + len(x), dtype=np.int64))
        if progress is not None:
            progress(start + len(x), n)


def _encode_rows(encode: _Encoder, vectors: Any, start: int, end: int, batch_size: int,
                 progress: ProgressFn | None = None, n: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``start`` to ``end`` of ``vectors`` as a part's inverted lists: ``(list_sizes, ids, codes)``, the entries
    grouped by list, in list order, and in row order within a list (as adding the rows in order fills each list)."""
    lists = np.empty(end - start, dtype=np.int64)
    codes = np.empty((end - start, encode.ivf.pq.code_size), dtype=np.uint8)
    for first, x in _batches(vectors, start, end, batch_size):
        at = slice(first - start, first - start + len(x))
        lists[at], codes[at] = encode.encode(x)
        if progress is not None:
            progress(first + len(x), n)
    order = np.argsort(lists, kind="stable")
    return np.bincount(lists, minlength=encode.ivf.nlist), start + order, codes[order]


def _write_parts(index, vectors: Any, n: int, batch_size: int, build_dir: Path,
                 progress: ProgressFn | None) -> list[Path]:
    """Encode all rows into part files in ``build_dir`` (build_ivfpq on disk): whole batches, at least
    :data:`PART_ROWS` rows a part (the last one shorter), so memory holds one part's codes and ids at a time."""
    encode = _Encoder(index)
    part_rows = -(-PART_ROWS // batch_size) * batch_size
    parts = []
    for start in range(0, n, part_rows):
        path = build_dir / f"part-{len(parts):06d}.npz"
        _write_part(path, *_encode_rows(encode, vectors, start, min(n, start + part_rows), batch_size, progress, n))
        parts.append(path)
    return parts


def _write_part(path: Path, list_sizes: np.ndarray, ids: np.ndarray, codes: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")  # one name per part: a rerun after a kill writes over its leftover
    with open(tmp, "wb") as f:
        np.savez(f, list_sizes=list_sizes, ids=ids, codes=codes)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _load_part(path: Path, *names: str) -> list[np.ndarray]:
    """The arrays ``names`` of a part file (an npz reads only the members asked for)."""
    from atlas.core.files import ArtifactError

    if not path.is_file():
        raise FileNotFoundError(f"index part {path} is missing")
    try:
        with np.load(path, allow_pickle=False) as part:
            return [part[name] for name in names]
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        raise ArtifactError(f"{path}: not a readable index part ({type(e).__name__}: {e}); write it again") from None


def _read_part(path: Path, nlist: int, code_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A part's ``(list_sizes, ids, codes)``, checked against the index it is merged into."""
    from atlas.core.files import ArtifactError

    list_sizes, ids, codes = _load_part(path, "list_sizes", "ids", "codes")
    if list_sizes.shape != (nlist,) or ids.shape != (int(list_sizes.sum()),) or codes.shape != (len(ids), code_size):
        raise ArtifactError(f"{path}: an index part of another index (list_sizes {list_sizes.shape}, ids "
                            f"{ids.shape}, codes {codes.shape}; this index has {nlist} lists of {code_size}-byte "
                            "codes); write it again")
    return list_sizes, ids, codes


def _list_sizes(parts: list[Path], nlist: int) -> np.ndarray:
    """The size of every list once all ``parts`` are merged (only their ``list_sizes`` are read)."""
    from atlas.core.files import ArtifactError

    sizes = np.zeros(nlist, dtype=np.int64)
    for path in parts:
        [part_sizes] = _load_part(path, "list_sizes")
        if part_sizes.shape != (nlist,):
            raise ArtifactError(f"{path}: an index part with {len(part_sizes)} lists, this index has {nlist}")
        sizes += part_sizes
    return sizes


def _merge_parts(index, parts: list[Path], sizes: np.ndarray, build_dir: Path, folder: Path, on_disk: bool) -> None:
    """Fill the empty lists of ``index`` with the entries of ``parts``, part after part; ``sizes``: the lists' sizes
    once merged (:func:`_list_sizes`).

    Every list is given its final size first, then each part's entries are copied to their place: one pass over the
    parts, and no list is ever moved or grown (appending would reallocate each list several times, and on disk leave
    holes). On disk, the lists go to a new ``OnDiskInvertedLists`` in ``build_dir``, back to back in list order, as its
    ``merge_from_multiple`` would place them; that needs every part open at once, this one part at a time.
    """
    import faiss

    ivf = faiss.extract_index_ivf(index)
    if on_disk:
        lists = faiss.OnDiskInvertedLists(ivf.nlist, ivf.code_size, str(build_dir / INVLISTS_FILE))
        with _stdout_to_stderr():  # FAISS prints "resizing <file>" on stdout
            lists.update_totsize(int(sizes.sum()) * (ivf.code_size + 8))  # a code and an int64 id per entry
        final_sizes = sizes.astype(np.uint64)  # size_t; kept in a name while FAISS reads it
        lists.set_all_lists_sizes(faiss.swig_ptr(final_sizes))
    else:
        lists = faiss.downcast_InvertedLists(ivf.invlists)  # the index's own, empty ArrayInvertedLists
        for list_no in np.flatnonzero(sizes).tolist():
            lists.resize(list_no, int(sizes[list_no]))
    filled = np.zeros(ivf.nlist, dtype=np.int64)  # entries already copied into each list
    for path in parts:
        part_sizes, ids, codes = _read_part(path, ivf.nlist, ivf.code_size)
        first = np.cumsum(part_sizes) - part_sizes  # where each list starts in the part
        for list_no in np.flatnonzero(part_sizes).tolist():
            a, b = int(first[list_no]), int(first[list_no] + part_sizes[list_no])
            lists.update_entries(list_no, int(filled[list_no]), b - a, faiss.swig_ptr(ids[a:b]),
                                 faiss.swig_ptr(codes[a:b]))
        filled += part_sizes
    if on_disk:
        # The path written into index.faiss: where the file will be once published (load_index ignores it anyway).
        lists.filename = str((folder / INVLISTS_FILE).absolute())
        ivf.replace_invlists(lists, True)
        lists.this.disown()  # the index owns it now
    index.ntotal = ivf.ntotal = int(sizes.sum())


def _facts(index) -> dict:
    import faiss

    ivf = faiss.downcast_index(faiss.extract_index_ivf(index))
    return {"n": int(index.ntotal), "d": int(index.d), "nlist": int(ivf.nlist), "m": int(ivf.pq.M),
            "code_bytes": int(ivf.code_size)}


def _files(folder: Path, on_disk: bool, n: int) -> dict:
    files = [INDEX_FILE, INVLISTS_FILE] if on_disk else [INDEX_FILE]
    size = sum((folder / name).stat().st_size for name in files)
    return {"on_disk": on_disk, "files": files, "bytes": size, "bytes_per_vector": size / n}


def _fresh_build_dir(folder: Path) -> Path:
    """``folder/.build``, created empty. A build killed midway leaves it behind, and the next build clears it: one
    build at a time per folder (the run lock sees to that for the index stage)."""
    folder.mkdir(parents=True, exist_ok=True)
    build_dir = folder / ".build"
    shutil.rmtree(build_dir, ignore_errors=True)
    build_dir.mkdir()
    return build_dir


def _write_index_atomically(index, path: Path) -> None:
    import faiss

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    faiss.write_index(index, str(tmp))
    _fsync(tmp)
    os.replace(tmp, path)


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
