"""Near-duplicate concepts as communities of a k-nearest-neighbour similarity graph.

One deduplication pass, as in the paper: keep an edge from each concept to each of its ``m`` nearest neighbours whose
cosine similarity is at least ``tau``, find Louvain communities in that graph, and merge each community into one
concept. The caller re-embeds the merged concepts and repeats with a lower ``tau`` (0.95, 0.90, 0.85).

A kNN graph (rather than every pair above ``tau``) keeps the graph at most ``n * m`` edges, and Louvain (rather than
connected components) stops a chain of pairwise-similar concepts from collapsing into one giant merge.
"""

from __future__ import annotations

import community as community_louvain  # python-louvain
import faiss
import networkx as nx
import numpy as np


def knn_graph(
    vectors: np.ndarray, m: int = 20, tau: float = 0.9, batch_size: int = 8192
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Builds the undirected similarity graph: edges to the ``m`` nearest neighbours with cosine >= ``tau``.

    The search is exact (``IndexFlatIP``) because the graph decides which concepts merge, and an approximate index
    would drop edges silently. Queries go in batches of ``batch_size`` so that memory for the results stays bounded
    whatever the number of concepts.

    Args:
        vectors: ``(n, d)`` L2-normalized embeddings, so that inner product is cosine similarity. They are not
            normalized here: normalizing is the embedder's job, and doing it twice would hide a bug there.
        m: Neighbours kept per node before thresholding (the node itself is not counted).
        tau: Minimum cosine similarity of an edge.
        batch_size: Queries per FAISS search.

    Returns:
        ``(sources, targets, weights)``: int64, int64 and float32 arrays of equal length, one entry per undirected
        edge with ``sources < targets``, no self-loops, no duplicates, sorted by ``(source, target)`` so that the
        graph (and therefore Louvain) does not depend on FAISS's tie order. An edge found from both ends keeps the
        larger of its two scores, which differ only by rounding.
    """
    x = np.ascontiguousarray(vectors, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"vectors must be 2-D (n, d), got shape {x.shape}")
    n = x.shape[0]
    k = min(m + 1, n)  # +1: a node is normally its own nearest neighbour
    if n == 0 or k <= 1:
        return np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float32)

    index = faiss.IndexFlatIP(x.shape[1])
    index.add(x)
    keys, scores = [], []
    for start in range(0, n, batch_size):
        sims, nbrs = index.search(x[start : start + batch_size], k)
        rows = np.arange(start, start + len(nbrs), dtype=np.int64)[:, None]
        # Self is excluded by id, not by position: exact duplicates can tie with it and come first.
        keep = (sims >= tau) & (nbrs >= 0) & (nbrs != rows)
        i = np.broadcast_to(rows, nbrs.shape)[keep]
        j = nbrs[keep].astype(np.int64)
        keys.append(np.minimum(i, j) * n + np.maximum(i, j))
        scores.append(sims[keep])

    key = np.concatenate(keys)
    weight = np.concatenate(scores).astype(np.float32)
    order = np.argsort(key, kind="stable")
    key, weight = key[order], weight[order]
    unique_key, first = np.unique(key, return_index=True)
    weight = np.maximum.reduceat(weight, first) if len(first) else weight
    return unique_key // n, unique_key % n, weight.astype(np.float32)


def louvain(
    n_nodes: int,
    sources: np.ndarray,
    targets: np.ndarray,
    weights: np.ndarray,
    seed: int = 0,
    resolution: float = 1.0,
) -> np.ndarray:
    """Louvain communities of a weighted graph, as dense ids that are reproducible for a seed.

    python-louvain visits nodes in the graph's insertion order (shuffled by ``seed``), so nodes ``0..n-1`` are
    inserted in order and then the edges in the order given (sorted, from :func:`knn_graph`): the same input and
    seed then give the same partition. Its community labels are arbitrary, so they are renumbered by smallest
    member: community 0 holds node 0, community 1 holds the smallest node not in community 0, and so on.

    Args:
        n_nodes: Number of nodes; every node appears in the result, an isolated one as its own community.
        sources: Edge endpoints (int), one per edge.
        targets: Other edge endpoints (int), one per edge.
        weights: Edge weights (cosine similarities), one per edge.
        seed: Random state for python-louvain's node order.
        resolution: Modularity resolution; above 1 gives smaller communities.

    Returns:
        ``(n_nodes,)`` int64 community id of each node, ids ``0..c-1`` numbered in order of smallest member.
    """
    graph = nx.Graph()
    graph.add_nodes_from(range(n_nodes))
    graph.add_weighted_edges_from(
        zip(np.asarray(sources).tolist(), np.asarray(targets).tolist(), np.asarray(weights, dtype=np.float64).tolist())
    )
    if graph.number_of_nodes() != n_nodes:
        raise ValueError(f"edges name nodes outside 0..{n_nodes - 1}")
    partition = community_louvain.best_partition(graph, weight="weight", random_state=seed, resolution=resolution)
    raw = np.fromiter((partition[node] for node in range(n_nodes)), dtype=np.int64, count=n_nodes)
    return _renumber_by_smallest_member(raw)


def merge_pass(vectors: np.ndarray, tau: float, m: int = 20, seed: int = 0) -> np.ndarray:
    """One deduplication pass: the community id of each concept, for the caller to merge communities.

    Args:
        vectors: ``(n, d)`` L2-normalized embeddings of "label: description".
        tau: Minimum cosine similarity of an edge.
        m: Neighbours per node in the kNN graph.
        seed: Random state for Louvain.

    Returns:
        ``(n,)`` int64 community ids, as from :func:`louvain`.
    """
    sources, targets, weights = knn_graph(vectors, m=m, tau=tau)
    return louvain(len(vectors), sources, targets, weights, seed=seed)


def _renumber_by_smallest_member(labels: np.ndarray) -> np.ndarray:
    """Maps arbitrary labels to ``0..c-1`` in order of each label's first (smallest) node."""
    if len(labels) == 0:
        return labels.astype(np.int64)
    unique, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
    rank = np.empty(len(unique), dtype=np.int64)
    rank[np.argsort(first)] = np.arange(len(unique))
    return rank[inverse.reshape(-1)]
