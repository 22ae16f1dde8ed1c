"""Louvain dedup of synthetic concepts against networkx's own Louvain, measured in the same process.

    python benchmarks/bench_louvain.py [--n 50000] [--dim 384] [--m 20] [--tau 0.9] [--seed 0] [--repeats 3]
                                      [--json PATH]

graph    = atlas.models.louvain.knn_graph: exact FAISS kNN (m neighbours, cosine >= tau), reported on its own
atlas    = atlas.models.louvain.louvain (python-louvain) on that graph, networkx graph construction included
baseline = networkx.algorithms.community.louvain_communities on the same edges, graph construction included

The synthetic concepts mimic a concept library before deduplication: ``--bases`` distinct concepts grouped in
topics of varying tightness (two concepts of one topic have cosine 0.25-0.94, as embeddings of related labels do), and
near-copies of some bases (1-4 each, cosine ~0.90-0.99 to their base) up to ``--n`` in all, shuffled.

Community runs alternate and the best of ``--repeats`` is kept, so machine noise hits both sides alike. Prints the
times, the ratio baseline / atlas for the community step and for the whole pass (graph + communities), the
agreement of the two partitions (adjusted Rand index) and, for each, the modularity and the fraction of planted
duplicate groups recovered exactly (one community holding the group and nothing else).
"""

from __future__ import annotations

import argparse
import time

import networkx as nx
import numpy as np
from _results import add_json_option, row, write_json
from networkx.algorithms.community import louvain_communities, modularity

from atlas.models.louvain import knn_graph, louvain


def synthetic_concepts(n: int, dim: int, n_bases: int, n_topics: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """L2-normalized concept embeddings with planted near-duplicate groups.

    Returns:
        ``(vectors, group)``: ``(n, dim)`` float32 and ``(n,)`` int64, where ``group`` is the base concept each row
        copies (a base is in its own group).
    """
    if not 0 < n_bases <= n:
        raise ValueError(f"--bases must be in 1..{n}")
    rng = np.random.default_rng(seed)

    def normalize(x: np.ndarray) -> np.ndarray:
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    # A base is a * topic + sqrt(1 - a^2) * noise, so two bases of one topic have cosine ~a^2. Topic tightness a is
    # drawn per topic: most topics are loose, but a few are tight enough (a^2 near tau) that distinct concepts
    # chain together, which is where Louvain (not connected components) has to decide what to merge.
    topics = normalize(rng.standard_normal((n_topics, dim)))
    topic = rng.integers(0, n_topics, n_bases)
    a = rng.uniform(0.5, 0.97, n_topics)[topic][:, None]
    bases = normalize(a * topics[topic] + np.sqrt(1 - a**2) * normalize(rng.standard_normal((n_bases, dim))))

    # Spread the n - n_bases copies over randomly chosen bases, 1-4 copies each.
    extra, owners = n - n_bases, []
    for base in rng.permutation(n_bases):
        if extra == 0:
            break
        k = min(int(rng.integers(1, 5)), extra)
        owners.extend([base] * k)
        extra -= k
    if extra:
        raise ValueError("too few bases for 4 copies each; raise --bases")
    owners = np.asarray(owners, dtype=np.int64)
    # Noise of relative norm r gives cosine 1 / sqrt(1 + r^2) to the base: r in [0.15, 0.45] -> cosine 0.91-0.99.
    r = rng.uniform(0.15, 0.45, len(owners))[:, None]
    copies = normalize(bases[owners] + r * normalize(rng.standard_normal((len(owners), dim))))

    group = np.concatenate([np.arange(n_bases), owners])
    perm = rng.permutation(n)
    return np.vstack([bases, copies]).astype(np.float32)[perm], group[perm]


def networkx_louvain(n_nodes: int, sources, targets, weights, seed: int) -> np.ndarray:
    """The baseline: networkx's Louvain on the same graph, as a label per node."""
    graph = nx.Graph()
    graph.add_nodes_from(range(n_nodes))
    graph.add_weighted_edges_from(zip(sources.tolist(), targets.tolist(), weights.astype(np.float64).tolist()))
    labels = np.empty(n_nodes, dtype=np.int64)
    for label, members in enumerate(louvain_communities(graph, weight="weight", resolution=1.0, seed=seed)):
        labels[list(members)] = label
    return labels


def groups_recovered(labels: np.ndarray, group: np.ndarray) -> float:
    """Fraction of planted groups with 2+ members that are exactly one community."""
    multi = np.flatnonzero(np.bincount(group) >= 2)
    # A group is recovered when all its members share one label and that label has no other members.
    label_size = np.bincount(labels)
    hits = 0
    for g in multi:
        members = labels[group == g]
        hits += bool(np.all(members == members[0]) and label_size[members[0]] == len(members))
    return hits / max(len(multi), 1)


def adjusted_rand(a: np.ndarray, b: np.ndarray) -> float | None:
    try:
        from sklearn.metrics import adjusted_rand_score
    except ImportError:
        return None
    return float(adjusted_rand_score(a, b))


def partition_modularity(n_nodes: int, sources, targets, weights, labels: np.ndarray) -> float:
    graph = nx.Graph()
    graph.add_nodes_from(range(n_nodes))
    graph.add_weighted_edges_from(zip(sources.tolist(), targets.tolist(), weights.astype(np.float64).tolist()))
    communities = [set() for _ in range(labels.max() + 1)]
    for node, label in enumerate(labels.tolist()):
        communities[label].add(node)
    return modularity(graph, communities, weight="weight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=50_000, help="concepts in all")
    parser.add_argument("--dim", type=int, default=384, help="embedding size (384: MiniLM, 1024: Qwen3-Embedding)")
    parser.add_argument("--bases", type=int, default=None, help="distinct concepts (default: 70%% of --n)")
    parser.add_argument("--topics", type=int, default=2000, help="topics the distinct concepts fall into")
    parser.add_argument("--m", type=int, default=20, help="neighbours per node in the kNN graph")
    parser.add_argument("--tau", type=float, default=0.9, help="minimum cosine of an edge")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="community runs per side; the best is kept")
    add_json_option(parser)
    args = parser.parse_args()
    n_bases = args.bases if args.bases is not None else int(0.7 * args.n)

    vectors, group = synthetic_concepts(args.n, args.dim, n_bases, args.topics, args.seed)
    n_groups = int(np.sum(np.bincount(group) >= 2))
    print(f"concepts: {args.n:,} x {args.dim} ({n_bases:,} distinct, {n_groups:,} planted duplicate groups)")

    start = time.perf_counter()
    sources, targets, weights = knn_graph(vectors, m=args.m, tau=args.tau)
    t_graph = time.perf_counter() - start
    print(f"kNN graph (FAISS IndexFlatIP, m={args.m}, tau={args.tau}): {t_graph:.2f} s, {len(sources):,} edges")

    t_atlas = t_base = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        ours = louvain(args.n, sources, targets, weights, seed=args.seed)
        t_atlas = min(t_atlas, time.perf_counter() - start)
        start = time.perf_counter()
        base = networkx_louvain(args.n, sources, targets, weights, seed=args.seed)
        t_base = min(t_base, time.perf_counter() - start)

    print(f"communities, atlas (python-louvain):         {t_atlas:.2f} s, {ours.max() + 1:,} communities")
    print(f"communities, baseline (networkx louvain):    {t_base:.2f} s, {base.max() + 1:,} communities")
    print(f"ratio baseline / atlas, community step:      {t_base / t_atlas:.2f}x")
    print(f"ratio baseline / atlas, whole pass:          {(t_graph + t_base) / (t_graph + t_atlas):.2f}x"
          f"  ({t_graph + t_atlas:.2f} s vs {t_graph + t_base:.2f} s)")
    ari = adjusted_rand(ours, base)
    print(f"agreement (adjusted Rand index):             {'n/a (no sklearn)' if ari is None else f'{ari:.4f}'}")
    quality = {}
    for name, labels in (("atlas", ours), ("baseline", base)):
        q = partition_modularity(args.n, sources, targets, weights, labels)
        quality[name] = (q, groups_recovered(labels, group))
        print(f"{name:>8}: modularity {q:.4f}, planted groups recovered {quality[name][1]:.1%}")
    (q_atlas, g_atlas), (q_base, g_base) = quality["atlas"], quality["baseline"]
    note = (f"ARI {'n/a' if ari is None else f'{ari:.3f}'}; modularity {q_atlas:.3f} vs {q_base:.3f}; "
            f"groups recovered {g_atlas:.1%} vs {g_base:.1%}")
    write_json(args.json, [
        row("louvain", f"community step, n={args.n:,}", t_atlas, t_base, "s", "networkx louvain_communities",
            ratio_is="baseline/atlas", note=note),
        row("louvain", f"whole pass (kNN graph + communities), n={args.n:,}", t_graph + t_atlas, t_graph + t_base, "s",
            "kNN graph + networkx louvain_communities", ratio_is="baseline/atlas")])


if __name__ == "__main__":
    main()
