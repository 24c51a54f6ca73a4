"""Algorithm 1's integer dispatch counts: hand-worked cases and the invariants under search."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lazarus_runtime.dispatch_counts import dispatch_counts, replica_capacity


def test_rank_without_a_local_replica_of_the_hot_expert_sends_by_residual_capacity():
    # Expert 0 is hot and has replicas only on ranks 1 and 2: p = 12 / 2 = 6 per replica.
    # Rank 0 keeps nothing and splits its 6 over the residuals 6-2=4 (rank 1) and 6-4=2
    # (rank 2). Expert 1 has 3 replicas, two on rank 0: p = 9 / 3 = 3, capacity [6, 3, 0].
    tokens = [[6, 2, 4],
              [1, 4, 4]]
    replicas = [[0, 1, 1],
                [2, 1, 0]]
    counts = dispatch_counts(tokens, replicas)
    np.testing.assert_array_equal(counts[0], [[0, 4, 2],
                                              [0, 2, 0],
                                              [0, 0, 4]])
    np.testing.assert_array_equal(counts[1], [[1, 0, 0],
                                              [1, 3, 0],
                                              [4, 0, 0]])


def test_uneven_split_gives_the_leftover_to_the_lowest_ranks():
    # t = 10 over 3 replicas: 4, 3, 3; rank 3 holds no replica and sends everything.
    counts = dispatch_counts([[0, 0, 0, 10]], [[1, 1, 1, 0]])
    np.testing.assert_array_equal(counts[0, 3], [4, 3, 3, 0])
    assert counts[0, :3].sum() == 0


def test_two_senders_share_two_receivers_in_proportion():
    # Leftovers 3 and 2, residuals 3 and 2: the ideal flows 1.8, 1.2, 1.2, 0.8 floor to
    # 1, 1, 1, 0; each sender then tops up the receiver short by most (ties: lowest rank).
    counts = dispatch_counts([[3, 2, 0, 0]], [[0, 0, 1, 1]])
    np.testing.assert_array_equal(counts[0], [[0, 0, 2, 1],
                                              [0, 0, 1, 1],
                                              [0, 0, 0, 0],
                                              [0, 0, 0, 0]])


def test_balanced_load_stays_local():
    counts = dispatch_counts([[5, 5], [7, 7]], [[1, 1], [1, 1]])
    assert (counts[:, 0, 1] == 0).all() and (counts[:, 1, 0] == 0).all()


def test_every_rank_computes_the_same_matrix_from_the_gathered_counts():
    # Each rank sees the all-gathered counts as its own array (dtype and container may
    # differ); rank j's send row must equal what every receiver expects from j.
    tokens = np.array([[9, 0, 3, 1], [0, 0, 12, 5]])
    replicas = np.array([[1, 1, 0, 1], [0, 2, 1, 0]])
    views = [dispatch_counts(tokens.astype(dt).tolist() if i % 2 else tokens.astype(dt),
                             replicas)
             for i, dt in enumerate([np.int64, np.int32, np.int16, np.int64])]
    for v in views[1:]:
        np.testing.assert_array_equal(v, views[0])


def test_expert_without_any_replica_is_a_clear_error():
    with pytest.raises(ValueError, match=r"experts \[1\] have no replica"):
        dispatch_counts([[1, 1], [1, 1]], [[1, 1], [0, 0]])


@st.composite
def gathered_counts(draw):
    W = draw(st.integers(1, 12))
    E = draw(st.integers(1, 4))
    replicas = np.array(draw(st.lists(st.lists(st.integers(0, 3), min_size=W, max_size=W),
                                      min_size=E, max_size=E)))
    for e in range(E):  # the plan schema guarantees a replica per expert
        if replicas[e].sum() == 0:
            replicas[e, draw(st.integers(0, W - 1))] = 1
    tokens = np.array(draw(st.lists(st.lists(st.integers(0, 200), min_size=W, max_size=W),
                                    min_size=E, max_size=E)))
    return tokens, replicas


@settings(max_examples=300, deadline=None)
@given(gathered_counts())
def test_invariants(case):
    tokens, replicas = case
    counts = dispatch_counts(tokens, replicas)
    capacity = replica_capacity(tokens.sum(1), replicas)
    assert (counts >= 0).all()
    # Every assignment is sent somewhere (no drops) ...
    np.testing.assert_array_equal(counts.sum(2), tokens)
    # ... and every rank computes exactly its replicas' share (no padding).
    np.testing.assert_array_equal(counts.sum(1), capacity)
    share = tokens.sum(1, keepdims=True) / replicas.sum(1, keepdims=True)
    assert (capacity >= np.floor(share) * replicas).all()
    assert (capacity <= np.ceil(share) * replicas).all()
    W = tokens.shape[1]
    diag = counts[:, np.arange(W), np.arange(W)]
    # Local replicas first: a rank keeps min(own tokens, capacity).
    np.testing.assert_array_equal(diag, np.minimum(tokens, capacity))
    # Leftovers spread in proportion to residual capacity, each flow within one of ideal.
    leftover, residual = tokens - diag, capacity - diag
    total = leftover.sum(1)
    for e in np.flatnonzero(total):
        remote = counts[e] - np.diag(diag[e])
        ideal = np.outer(leftover[e], residual[e]) / total[e]
        assert np.abs(remote - ideal).max() <= 1
