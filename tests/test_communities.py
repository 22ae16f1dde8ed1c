"""kNN similarity graph and Louvain communities for near-duplicate concepts (atlas.models.louvain)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("faiss")
pytest.importorskip("community")

from atlas.models.louvain import knn_graph, louvain, merge_pass  # noqa: E402

N_GROUPS, GROUP_SIZE, DIM = 50, 4, 64


def _normalize(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def groups() -> tuple[np.ndarray, np.ndarray]:
    """50 random directions in 64-d, each with 4 noisy copies (cosine ~0.98 within a group, ~0 across groups)."""
    rng = np.random.default_rng(0)
    centers = _normalize(rng.standard_normal((N_GROUPS, DIM)))
    truth = np.repeat(np.arange(N_GROUPS), GROUP_SIZE)
    vectors = _normalize(centers[truth] + 0.02 * rng.standard_normal((len(truth), DIM)))
    # Shuffle so that a group's members are not adjacent ids.
    perm = rng.permutation(len(truth))
    return vectors[perm], truth[perm]


def _same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    pairs = set(zip(a.tolist(), b.tolist()))
    return len(pairs) == len(set(a.tolist())) == len(set(b.tolist()))


def test_each_duplicate_group_is_one_community(groups):
    vectors, truth = groups
    ids = merge_pass(vectors, tau=0.9)
    assert _same_partition(ids, truth)
    assert ids.max() + 1 == N_GROUPS


def test_tau_above_every_similarity_gives_singletons(groups):
    vectors, _ = groups
    sources, _, _ = knn_graph(vectors, tau=1.01)
    assert len(sources) == 0
    np.testing.assert_array_equal(merge_pass(vectors, tau=1.01), np.arange(len(vectors)))


def test_edges_are_unique_sorted_upper_triangle_above_tau(groups):
    vectors, truth = groups
    sources, targets, weights = knn_graph(vectors, m=20, tau=0.9, batch_size=7)  # odd batches: ids must survive
    assert sources.dtype == targets.dtype == np.int64 and weights.dtype == np.float32
    assert len(sources) > 0
    assert np.all(sources < targets)
    keys = sources * len(vectors) + targets
    assert np.all(np.diff(keys) > 0)  # sorted by (i, j) and unique
    assert np.all(weights >= 0.9)
    # Every within-group pair is an edge (each node has 3 duplicates, well under m), and no cross-group pair is.
    assert np.all(truth[sources] == truth[targets])
    assert len(sources) == N_GROUPS * GROUP_SIZE * (GROUP_SIZE - 1) // 2
    np.testing.assert_allclose(weights, np.sum(vectors[sources] * vectors[targets], axis=1), atol=1e-5)


def test_m_bounds_the_neighbours(groups):
    vectors, _ = groups
    sources, targets, _ = knn_graph(vectors, m=1, tau=0.9)
    # Each node contributes at most one edge; symmetric picks collapse into one.
    assert len(sources) <= len(vectors)
    assert len(set(zip(sources.tolist(), targets.tolist()))) == len(sources)


def test_exact_duplicates_give_no_self_loops():
    vectors = _normalize(np.ones((5, 8)))
    sources, targets, weights = knn_graph(vectors, m=20, tau=0.9)
    assert np.all(sources != targets)
    assert len(sources) == 10  # all pairs of 5 nodes, once each
    np.testing.assert_array_equal(merge_pass(vectors, tau=0.9), np.zeros(5, dtype=np.int64))


def test_deterministic_for_a_seed():
    # A graph where Louvain has real choices to make: overlapping noisy clusters.
    rng = np.random.default_rng(1)
    centers = _normalize(rng.standard_normal((30, 16)))
    vectors = _normalize(centers[rng.integers(0, 30, 600)] + 0.25 * rng.standard_normal((600, 16)))
    graph = knn_graph(vectors, m=10, tau=0.5)
    first = louvain(len(vectors), *graph, seed=3)
    for _ in range(3):
        np.testing.assert_array_equal(louvain(len(vectors), *graph, seed=3), first)
    np.testing.assert_array_equal(merge_pass(vectors, tau=0.5, m=10, seed=3), first)


def test_isolated_nodes_are_their_own_communities():
    # Nodes 0, 3 and 6 have no edges; {1, 2} and {4, 5, 7} are triangles/pairs.
    sources = np.array([1, 4, 4, 5])
    targets = np.array([2, 5, 7, 7])
    weights = np.ones(4, dtype=np.float32)
    ids = louvain(9, sources, targets, weights)
    np.testing.assert_array_equal(ids, [0, 1, 1, 2, 3, 3, 4, 3, 5])


def test_ids_are_dense_and_ordered_by_smallest_member(groups):
    vectors, _ = groups
    ids = merge_pass(vectors, tau=0.9)
    assert ids.dtype == np.int64
    assert set(ids.tolist()) == set(range(ids.max() + 1))
    smallest = [np.flatnonzero(ids == c).min() for c in range(ids.max() + 1)]
    assert smallest == sorted(smallest)
    assert ids[0] == 0


def test_empty_and_tiny_inputs():
    empty = np.zeros((0, 8), dtype=np.float32)
    assert all(len(a) == 0 for a in knn_graph(empty))
    assert len(merge_pass(empty, tau=0.9)) == 0
    np.testing.assert_array_equal(merge_pass(_normalize(np.ones((1, 8))), tau=0.9), [0])
