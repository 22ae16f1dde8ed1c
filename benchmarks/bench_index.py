"""The IVFPQ attribution index (atlas.models.ivfpq) against an exact IndexFlatIP, on synthetic
sentence-like embeddings.

    python benchmarks/bench_index.py [--n 1000000] [--d 384] [--code-bytes 64] [--seed 0] [--variants mem,disk,map]
                                     [--shards 8] [--rerank 0,100] [--threads T] [--dup-frac 0.05] [--keep DIR]
                                     [--json PATH]

data     = ``--n`` unit vectors, float16 in an ``np.memmap`` under a temporary folder (as ``embeddings.zarr`` stores
           them), generated in batches so memory stays bounded (see :func:`synthetic_embeddings`)
atlas    = ``atlas.models.ivfpq.build_ivfpq`` with its defaults (nlist_for(n) lists, ``--code-bytes`` PQ
           code), loaded with ``load_index`` (memory-mapped); ``mem`` keeps the lists in ``index.faiss``,
           ``disk`` writes the lists of each ~1M rows to a part file and merges them into ``invlists.ondisk``;
           ``map`` is the index stage's map + merge in one process: ``train_ivfpq`` once, ``add_part`` for each of
           ``--shards`` row ranges, ``merge_parts`` (lists on disk above 2M rows); it makes the ``mem`` index
baseline = ``faiss.IndexFlatIP`` over the same vectors in float32 (exact; it holds all of them in memory)

Recall is the paper's: 1,000 indexed rows are searched (k = 10) and a hit is the row itself in its top 10, at
nprobe 1, 4, 16 and 64; the exact baseline gives the ceiling (a row with 10 or more exact duplicates is missed even
there). ``--rerank R`` adds rows where the R best PQ candidates are re-scored exactly from the stored float16 vectors.
Search speed is queries per second on 1,000 other rows, one batched call, best of 5; the ratio is atlas / baseline.
Memory is measured in a fresh process per phase (build, search, flat), so the figures do not mix: peak RSS (VmHWM,
like ``ru_maxrss``) counts the pages of the memory-mapped vector file a phase has read, so the peak of RssAnon (the
heap, sampled every 20 ms) is printed next to it as "RSS/anon": that is the part that would grow with N in memory.

Synthetic data: real sentence embeddings are anisotropic (a few directions carry much of the variance, and unrelated
texts still have a positive cosine), are grouped in topics of varying tightness, and a web corpus repeats boilerplate
(cookie notices, licences, navigation) as near-duplicate chunks. The generator plants all three: 4,000 topics with
Zipf-like sizes and a spread per topic (cosine to the topic centre 0.55-0.85), noise with a decaying spectrum around a
shared mean direction, and ``--dup-frac`` of the rows as near-copies of 2,000 templates (cosine 0.94-0.995 to their
template, Zipf popularity, so a few templates have hundreds of copies). The near-copies are what makes self-recall
fall short of 1: PQ errors are ~0.02-0.05 in cosine, larger than the gaps between copies of one template.
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from _results import add_json_option, row, write_json

TOPICS = 4000
TEMPLATES = 2000
MEAN_WEIGHT = 0.35  # weight of the shared direction in every topic centre: unrelated rows have cosine ~0.1
GEN_BATCH = 65536
SAMPLE = 1000
NPROBES = (1, 4, 16, 64)
REPEATS = 5  # timed search calls; the best is kept (other processes share the cores)


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def synthetic_embeddings(path: Path, n: int, d: int, seed: int, dup_frac: float) -> np.memmap:
    """Write ``n`` sentence-like unit vectors (float16) to an ``np.memmap`` at ``path``, GEN_BATCH rows at a time."""
    rng = np.random.default_rng(seed)
    scales = 1 / np.sqrt(np.arange(1, d + 1, dtype=np.float32))  # decaying spectrum of the noise
    scales /= np.linalg.norm(scales)  # so that noise of "size" s has norm ~s
    basis = np.linalg.qr(rng.standard_normal((d, d)))[0].astype(np.float32)  # its random orientation
    mean = _unit(rng.standard_normal((1, d)))[0].astype(np.float32)

    def noise(m: int) -> np.ndarray:
        return (rng.standard_normal((m, d), dtype=np.float32) * scales) @ basis

    centres = _unit(MEAN_WEIGHT * mean + _unit(rng.standard_normal((TOPICS, d), dtype=np.float32))).astype(np.float32)
    spread = np.sqrt(1 / rng.uniform(0.55, 0.85, TOPICS) ** 2 - 1).astype(np.float32)  # cosine 0.55-0.85 to centre
    topic_p = 1 / (np.arange(TOPICS) + 20.0)
    topic_p /= topic_p.sum()
    template_topic = rng.choice(TOPICS, TEMPLATES, p=topic_p)
    templates = _unit(centres[template_topic] + spread[template_topic, None] * noise(TEMPLATES)).astype(np.float32)
    template_spread = np.sqrt(1 / rng.uniform(0.94, 0.995, TEMPLATES) ** 2 - 1).astype(np.float32)
    template_p = 1 / (np.arange(TEMPLATES) + 5.0)
    template_p /= template_p.sum()

    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(n, d))
    for start in range(0, n, GEN_BATCH):
        m = min(GEN_BATCH, n - start)
        topic = rng.choice(TOPICS, m, p=topic_p)
        x = centres[topic] + spread[topic, None] * noise(m)
        copy = rng.random(m) < dup_frac
        t = rng.choice(TEMPLATES, int(copy.sum()), p=template_p)
        x[copy] = templates[t] + template_spread[t, None] * noise(len(t))
        out[start:start + m] = _unit(x)
    out.flush()
    return out


def _peak_rss_mb() -> float:
    """Peak RSS of this process in MB: VmHWM where Linux has it, else ``ru_maxrss``.

    ``getrusage(RUSAGE_SELF).ru_maxrss`` survives ``exec``: a child started by multiprocessing's "spawn" (fork, then
    exec) reports at least its parent's RSS at the fork. VmHWM belongs to the process' own address space. Both count
    the resident pages of memory-mapped files: the float16 vectors (768 MB at 1M x 384) once a pass has read them.
    """
    status = _proc_status()
    if "VmHWM" in status:
        return status["VmHWM"] / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _proc_status() -> dict[str, int]:
    """The kB fields of /proc/self/status (empty where there is no /proc)."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in lines) if v.strip().endswith("kB")}


class _AnonPeak:
    """Samples RssAnon (heap, not memory-mapped files) every 20 ms in a thread: the memory a phase really holds."""

    def __init__(self) -> None:
        self.peak_kb, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak_kb = max(self.peak_kb, _proc_status().get("RssAnon", 0))

    def stop_mb(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak_kb, _proc_status().get("RssAnon", 0)) / 1024


def _queries_per_second(index, queries: np.ndarray, **kwargs) -> float:
    from atlas.models.ivfpq import search

    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        search(index, queries, 10, **kwargs)
        best = min(best, time.perf_counter() - start)
    return len(queries) / best


def _phase_build(data: str, folder: str, variant: str, code_bytes: int, threads: int | None, shards: int) -> dict:
    from atlas.models.ivfpq import build_ivfpq

    anon = _AnonPeak()
    vectors = np.load(data, mmap_mode="r")
    if variant == "map":
        stats = _map_merge(vectors, Path(folder), code_bytes, threads, shards)
    else:
        stats = build_ivfpq(vectors, folder, code_bytes=code_bytes, on_disk=variant == "disk", threads=threads)
    return {**stats, "peak_rss_mb": _peak_rss_mb(), "peak_anon_mb": anon.stop_mb()}


def _map_merge(vectors: np.ndarray, folder: Path, code_bytes: int, threads: int | None, shards: int) -> dict:
    """The index stage's build, its shards one after the other: add_seconds counts the shards and the merge."""
    from atlas.models.ivfpq import add_part, merge_parts, train_ivfpq

    trained = train_ivfpq(vectors, folder / "trained.faiss", code_bytes=code_bytes, threads=threads)
    bounds = np.linspace(0, len(vectors), shards + 1).astype(int).tolist()
    parts = [folder / "_parts" / f"shard-{i:05d}.npz" for i in range(shards)]
    start = time.perf_counter()
    for a, b, part in zip(bounds, bounds[1:], parts):
        add_part(folder / "trained.faiss", vectors, a, b, part, threads=threads)
    merged = merge_parts(folder / "trained.faiss", parts, folder)
    shutil.rmtree(folder / "_parts")
    return merged | {"train_size": trained["train_size"], "train_seconds": trained["train_seconds"],
                     "add_seconds": time.perf_counter() - start}


def _phase_search(data: str, folder: str, reranks: list[int], seed: int, threads: int | None) -> dict:
    from atlas.models.ivfpq import load_index, self_recall

    anon = _AnonPeak()
    vectors = np.load(data, mmap_mode="r")
    index = load_index(folder)
    out: dict = {"recall": {}, "qps": {}}
    for rerank in reranks:
        for nprobe in NPROBES:
            out["recall"][(rerank, nprobe)] = self_recall(index, vectors, SAMPLE, 10, nprobe, seed, rerank=rerank,
                                                          threads=threads)
        queries = _other_rows(vectors, seed)
        out["qps"][rerank] = _queries_per_second(index, queries, nprobe=16, rerank=rerank, vectors=vectors,
                                                 threads=threads)
    out["peak_rss_mb"], out["peak_anon_mb"] = _peak_rss_mb(), anon.stop_mb()
    return out


def _phase_flat(data: str, seed: int, threads: int | None) -> dict:
    import faiss

    from atlas.models.ivfpq import self_recall

    if threads is not None:
        faiss.omp_set_num_threads(threads)
    anon = _AnonPeak()
    vectors = np.load(data, mmap_mode="r")
    index = faiss.IndexFlatIP(vectors.shape[1])
    start = time.perf_counter()
    for i in range(0, len(vectors), GEN_BATCH):
        index.add(np.asarray(vectors[i:i + GEN_BATCH], dtype=np.float32))
    build = time.perf_counter() - start
    return {"recall": self_recall(index, vectors, SAMPLE, 10, 16, seed), "build_seconds": build,
            "qps": _queries_per_second(index, _other_rows(vectors, seed)), "bytes_per_vector": 4 * vectors.shape[1],
            "peak_rss_mb": _peak_rss_mb(), "peak_anon_mb": anon.stop_mb()}


def _other_rows(vectors: np.ndarray, seed: int) -> np.ndarray:
    """1,000 rows not in self_recall's sample (a different seed; overlaps are few and harmless), for timing."""
    rows = np.sort(np.random.default_rng(seed + 1).choice(len(vectors), min(SAMPLE, len(vectors)), replace=False))
    return np.asarray(vectors[rows], dtype=np.float32)


def _mb(phase: dict) -> str:
    return f"{phase['peak_rss_mb']:.0f}/{phase['peak_anon_mb']:.0f}MB"


def _in_child(fn, *args):
    """Run ``fn(*args)`` in a fresh process, so that its peak RSS is its own."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def _result_rows(n: int, rows: list, reranks: list[int], flat: dict | None) -> list[dict]:
    """Per variant: search speed at nprobe 16 (per rerank) and bytes per vector, against the exact index."""
    out = []
    flat_note = f" (flat {flat['recall']:.3f})" if flat else ""
    for variant, built, searched in rows:
        for rerank in reranks:
            name = f"ivfpq-{variant}" + (f" rr{rerank}" if rerank else "")
            out.append(row("index", f"{name} search, nprobe 16, n={n:,}", searched["qps"][rerank],
                           flat["qps"] if flat else None, "queries/s", "exact faiss IndexFlatIP",
                           note=f"R@10 {searched['recall'][(rerank, 16)]:.3f}{flat_note}"))
        out.append(row("index", f"ivfpq-{variant} size, n={n:,}", built["bytes_per_vector"],
                       flat["bytes_per_vector"] if flat else None, "bytes/vector", "exact faiss IndexFlatIP",
                       better="lower", note=f"build {built['train_seconds'] + built['add_seconds']:.1f} s"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--d", type=int, default=384)
    parser.add_argument("--code-bytes", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", default="mem,disk,map", help="comma-separated subset of mem,disk,map")
    parser.add_argument("--shards", type=int, default=8, help="row ranges of the map variant")
    parser.add_argument("--rerank", default="0,100", help="comma-separated candidate counts to re-rank (0: none)")
    parser.add_argument("--dup-frac", type=float, default=0.05, help="share of rows that are near-duplicates")
    parser.add_argument("--threads", type=int, default=None, help="FAISS OpenMP threads (default: FAISS' own)")
    parser.add_argument("--no-flat", action="store_true", help="skip the exact baseline")
    parser.add_argument("--keep", default=None, help="work in this folder and keep it (data + indexes)")
    add_json_option(parser)
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    reranks = [int(r) for r in args.rerank.split(",") if r]

    import faiss

    from atlas.models.ivfpq import nlist_for

    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench_index_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        print(f"n={args.n:,} d={args.d} code_bytes={args.code_bytes} nlist={nlist_for(args.n)} seed={args.seed} "
              f"dup_frac={args.dup_frac}; FAISS {faiss.__version__}, threads "
              f"{args.threads or faiss.omp_get_max_threads()}; work in {work}", flush=True)
        data = work / f"vectors-{args.n}-{args.d}-{args.seed}-{args.dup_frac}.npy"
        start = time.perf_counter()
        if not data.exists():
            synthetic_embeddings(data, args.n, args.d, args.seed, args.dup_frac)
        print(f"data: {time.perf_counter() - start:.1f} s, {data.stat().st_size / 1e9:.2f} GB float16", flush=True)

        rows = []
        for variant in variants:
            folder = str(work / f"index-{variant}")
            built = _in_child(_phase_build, str(data), folder, variant, args.code_bytes, args.threads, args.shards)
            print(f"[{variant}] built: train {built['train_seconds']:.1f} s + add {built['add_seconds']:.1f} s "
                  f"(train_size {built['train_size']:,}, nlist {built['nlist']}, m {built['m']}), "
                  f"{built['bytes'] / 1e6:.1f} MB, peak RSS {built['peak_rss_mb']:.0f} MB, "
                  f"anon {built['peak_anon_mb']:.0f} MB",
                  flush=True)
            searched = _in_child(_phase_search, str(data), folder, reranks, args.seed, args.threads)
            rows.append((variant, built, searched))
        flat = None if args.no_flat else _in_child(_phase_flat, str(data), args.seed, args.threads)

        print()
        header = (f"{'index':<16} {'R@10 np1':>8} {'np4':>6} {'np16':>6} {'np64':>6} {'B/vec':>6} {'build s':>8} "
                  f"{'q/s np16':>9} {'x flat':>7} {'RSS/anon build':>15} {'RSS/anon search':>16}")
        print(header)
        print("-" * len(header))
        for variant, built, searched in rows:
            for rerank in reranks:
                name = f"ivfpq-{variant}" + (f" rr{rerank}" if rerank else "")
                recalls = " ".join(f"{searched['recall'][(rerank, p)]:>{8 if p == 1 else 6}.3f}" for p in NPROBES)
                qps = searched["qps"][rerank]
                ratio = f"{qps / flat['qps']:>7.1f}" if flat else f"{'-':>7}"
                print(f"{name:<16} {recalls} {built['bytes_per_vector']:>6.1f} "
                      f"{built['train_seconds'] + built['add_seconds']:>8.1f} {qps:>9.0f} {ratio} "
                      f"{_mb(built):>15} {_mb(searched):>16}")
        if flat:
            recall = f"{flat['recall']:>8.3f} {'':>6} {'':>6} {'':>6}"
            print(f"{'flat (exact)':<16} {recall} {flat['bytes_per_vector']:>6.0f} {flat['build_seconds']:>8.1f} "
                  f"{flat['qps']:>9.0f} {1:>7.1f} {'':>15} {_mb(flat):>16}")
        write_json(args.json, _result_rows(args.n, rows, reranks, flat))
        print("\nR@10: share of 1,000 indexed rows found in their own top 10 (the paper: 0.968 at nprobe 16). "
              "flat recall ignores nprobe.")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
