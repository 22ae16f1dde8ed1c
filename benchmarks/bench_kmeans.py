"""The k-means sweep of the concept library against scikit-learn's MiniBatchKMeans, measured in the same process.

    python benchmarks/bench_kmeans.py [--n 1000000] [--dim 384] [--ks 100,1000,10000] [--baseline-max-k K]
                                      [--threads T] [--json PATH]

data     = ``--n`` synthetic unit vectors: a uniform mixture of 2,000 random directions plus Gaussian noise of
           norm ~1 (cosine ~0.7 to their direction), float32
atlas    = ``atlas.models.kmeans.kmeans(x, k)`` (FAISS spherical k-means, at most 20 iterations on a subsample of
           k * 256 points) + ``assign(x, centroids)`` over all n points
baseline = ``MiniBatchKMeans(k, batch_size=4096, n_init=1, max_iter=20, random_state=seed).fit(x)`` +
           ``.predict(x)``; at most 20 passes over the data, usually far fewer because of its early stopping
           (``max_no_improvement=10`` mini-batches)

Quality is the same number for both: the mean cosine similarity of 10,000 held-out points (same mixture, not in
the training data) to their nearest centroid, with both sets of centroids normalized. Prints, per k, the seconds of
each side, the speed-up baseline / atlas, the quality of each and the passes the baseline made over the data.

Before running, the script times the two kernels the sides spend their time in (a dense points x centroids
product, and scikit-learn's k-means++ seeding of the baseline) and prints an estimate of every run. It is an
upper bound, 1 to 4 times the real time in our runs: it assumes all 20 iterations (FAISS stops once converged)
and NumPy's product speed (FAISS' is often higher). At the defaults (1M points, k up to 10,000) expect most of an
hour on one core, mostly k = 10,000: there atlas trains on all 1M points (10,000 * 256 > 1M), ~90 s an iteration.

Both sides get the same threads: the environment's (``OMP_NUM_THREADS``), or ``--threads`` for the OpenMP and BLAS
pools of FAISS, NumPy and scikit-learn alike. When other processes hold some of the cores, spinning thread pools
can make 2 threads several times slower than 1 (scikit-learn's k-means++ seeding most of all): compare both.
"""

from __future__ import annotations

import argparse
import time

import faiss
import numpy as np
from _results import add_json_option, row, write_json
from sklearn.cluster import MiniBatchKMeans, kmeans_plusplus
from threadpoolctl import threadpool_limits

from atlas.models.kmeans import assign, kmeans

DIRECTIONS = 2000
NOISE = 1.0  # norm of the noise vector, relative to the unit direction
HELD_OUT = 10_000
CHUNK = 100_000
NITER = 20  # atlas' Lloyd iterations, and the baseline's most passes over the data
MAX_POINTS_PER_CENTROID = 256
BATCH_SIZE = 4096


def synthetic(n: int, centers: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``n`` normalized float32 points around random ``centers``, generated in chunks to bound the temporaries."""
    x = np.empty((n, centers.shape[1]), dtype=np.float32)
    scale = np.float32(NOISE / np.sqrt(centers.shape[1]))
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        chunk = rng.standard_normal((m, centers.shape[1]), dtype=np.float32)
        chunk *= scale
        chunk += centers[rng.integers(0, len(centers), size=m)]
        chunk /= np.linalg.norm(chunk, axis=1, keepdims=True)
        x[start:start + m] = chunk
    return x


def quality(held_out: np.ndarray, centroids: np.ndarray) -> float:
    """Mean cosine similarity of held-out points to their nearest centroid (centroids normalized here)."""
    centroids = centroids / np.linalg.norm(centroids, axis=1, keepdims=True)
    return float(assign(held_out, centroids)[1].mean())


def flops_per_second(dim: int) -> float:
    """Speed of one (4096 x dim) by (dim x 1024) float32 product, the kernel both sides spend their time in."""
    a = np.ones((BATCH_SIZE, dim), dtype=np.float32)
    b = np.ones((dim, 1024), dtype=np.float32)
    a @ b
    start = time.perf_counter()
    for _ in range(5):
        a @ b
    return 5 * 2 * BATCH_SIZE * dim * 1024 / (time.perf_counter() - start)


def seeding_seconds_per_unit(dim: int) -> float:
    """Seconds per (centre x trial x point) of scikit-learn's k-means++, timed on a small problem."""
    x = np.random.default_rng(0).standard_normal((BATCH_SIZE, dim), dtype=np.float32)
    start = time.perf_counter()
    kmeans_plusplus(x, 100, random_state=0)
    return (time.perf_counter() - start) / _seeding_units(100, BATCH_SIZE)


def _seeding_units(k: int, points: int) -> float:
    return k * (2 + np.log(k)) * points  # scikit-learn tries 2 + log(k) candidates per centre


def estimate(n: int, dim: int, k: int, speed: float, seeding: float) -> tuple[float, float, float]:
    """Seconds of (atlas, baseline at 1 pass, baseline at NITER passes), from the work each must do."""
    product = 2 * k * dim / speed  # seconds to compare one point with all k centroids
    atlas = (NITER * min(n, k * MAX_POINTS_PER_CENTROID) + n) * product
    init = _seeding_units(k, min(n, 3 * max(BATCH_SIZE, k))) * seeding  # MiniBatchKMeans' default init_size
    return float(atlas), float(init + 2 * n * product), float(init + (NITER + 1) * n * product)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1_000_000, help="points to cluster")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--ks", default="100,1000,10000", help="comma-separated numbers of clusters")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline-max-k", type=int, default=None, help="skip the baseline for larger k")
    parser.add_argument("--threads", type=int, default=None, help="OpenMP/BLAS threads (default: the environment's)")
    add_json_option(parser)
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    if args.threads is not None:
        threadpool_limits(args.threads)  # every pool loaded by now: FAISS', NumPy's and scikit-learn's
        faiss.omp_set_num_threads(args.threads)

    speed, seeding = flops_per_second(args.dim), seeding_seconds_per_unit(args.dim)
    print(f"n={args.n:,} dim={args.dim} ks={ks} seed={args.seed}; threads: {faiss.omp_get_max_threads()}, "
          f"float32 products at {speed / 1e9:.0f} GFLOP/s")
    total = 0.0
    for k in ks:
        atlas, low, high = estimate(args.n, args.dim, k, speed, seeding)
        run_baseline = args.baseline_max_k is None or k <= args.baseline_max_k
        total += atlas + (high if run_baseline else 0.0)
        baseline = f"baseline {low / 60:.1f} to {high / 60:.1f} min" if run_baseline else "baseline skipped"
        print(f"  estimate (upper bound) k={k}: atlas {atlas / 60:.1f} min, {baseline}")
    if total > 20 * 60:
        print(f"WARNING: this may take up to ~{total / 3600:.1f} h; a smaller --n or --baseline-max-k K is faster")

    rng = np.random.default_rng(args.seed)
    centers = rng.standard_normal((DIRECTIONS, args.dim), dtype=np.float32)
    centers /= np.linalg.norm(centers, axis=1, keepdims=True)
    start = time.perf_counter()
    x = synthetic(args.n, centers, rng)
    held_out = synthetic(HELD_OUT, centers, rng)
    print(f"data: {time.perf_counter() - start:.1f} s, {x.nbytes / 1e9:.2f} GB\n", flush=True)

    print(f"{'k':>7} {'atlas s':>9} {'baseline s':>11} {'speed-up':>9} {'atlas q':>8} {'baseline q':>11} "
          f"{'passes':>7}")
    rows = []
    for k in ks:
        start = time.perf_counter()
        centroids = kmeans(x, k, seed=args.seed, niter=NITER, max_points_per_centroid=MAX_POINTS_PER_CENTROID)
        assign(x, centroids)
        atlas_s = time.perf_counter() - start
        atlas_q = quality(held_out, centroids)
        print(f"{k:>7} {atlas_s:>9.1f}", end="", flush=True)  # the baseline can take much longer: show atlas now
        if args.baseline_max_k is not None and k > args.baseline_max_k:
            print(f" {'skipped':>11} {'':>9} {atlas_q:>8.4f}", flush=True)
            rows.append(row("kmeans", f"k={k:,}, n={args.n:,}", atlas_s, None, "s", "scikit-learn MiniBatchKMeans",
                            ratio_is="baseline/atlas", note=f"baseline skipped; quality {atlas_q:.4f}"))
            continue
        start = time.perf_counter()
        model = MiniBatchKMeans(n_clusters=k, batch_size=BATCH_SIZE, n_init=1, max_iter=NITER,
                                random_state=args.seed).fit(x)
        model.predict(x)
        base_s = time.perf_counter() - start
        base_q = quality(held_out, model.cluster_centers_)
        passes = model.n_steps_ * BATCH_SIZE / args.n
        print(f" {base_s:>11.1f} {base_s / atlas_s:>9.2f} {atlas_q:>8.4f} {base_q:>11.4f} {passes:>7.1f}", flush=True)
        rows.append(row("kmeans", f"k={k:,}, n={args.n:,}", atlas_s, base_s, "s", "scikit-learn MiniBatchKMeans",
                        ratio_is="baseline/atlas",
                        note=f"quality {atlas_q:.4f} vs {base_q:.4f}; baseline {passes:.1f} passes"))
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
