"""Exact integer token-dispatch counts: the paper's Algorithm 1 (design.md, algorithms §4).

Legend: E experts, W ranks. ``tokens_EW[e, j]`` is the number of (token, top-k slot)
assignments routed to expert e on rank j; ``replicas_EW[e, j]`` the replicas of e that rank j
holds. The result ``counts_EWW[e, src, dst]`` is how many of src's assignments for e are
computed on dst.

Principle: every replica of e should compute p_e = t_e / r_e assignments. Rank j can serve
P_ej = p_e * R_ej; it keeps its own assignments up to that capacity, and whatever it cannot
keep goes to the ranks with capacity left, in proportion to that residual capacity. Because
sum_j P_ej = t_e = sum_j T_ej, the leftovers exactly fill the residuals.

Everything is integer arithmetic with fixed tie-breaking (lowest rank wins), so every rank
computes the same matrix from the same all-gathered counts, and the send splits of one rank
equal the receive splits its peers expect.
"""
from __future__ import annotations

import numpy as np


def replica_capacity(tokens_E: np.ndarray, replicas_EW: np.ndarray) -> np.ndarray:
    """Assignments each rank must compute per expert: t_e split evenly over r_e replicas.

    A replica gets floor(t_e / r_e); the t_e mod r_e leftover assignments go one each to the
    replicas in rank order, so capacities differ by at most one per replica.
    """
    num_replicas_E = replicas_EW.sum(axis=1)
    assert (num_replicas_E > 0).all(), "every expert needs a replica"
    base_E, extra_E = np.divmod(tokens_E, num_replicas_E)
    replicas_before_EW = np.cumsum(replicas_EW, axis=1) - replicas_EW
    extra_EW = np.clip(extra_E[:, None] - replicas_before_EW, 0, replicas_EW)
    return base_E[:, None] * replicas_EW + extra_EW


def dispatch_counts(tokens_EW: np.ndarray, replicas_EW: np.ndarray) -> np.ndarray:
    """Algorithm 1: ``counts_EWW[e, src, dst]`` with row sums T and column sums = capacity."""
    tokens_EW = np.asarray(tokens_EW, dtype=np.int64)
    replicas_EW = np.asarray(replicas_EW, dtype=np.int64)
    if tokens_EW.shape != replicas_EW.shape or tokens_EW.ndim != 2:
        raise ValueError(f"tokens {tokens_EW.shape} and replicas {replicas_EW.shape} must "
                         "both be (experts, ranks)")
    if (tokens_EW < 0).any() or (replicas_EW < 0).any():
        raise ValueError("token and replica counts must be >= 0")
    if (replicas_EW.sum(axis=1) == 0).any():
        missing = np.flatnonzero(replicas_EW.sum(axis=1) == 0).tolist()
        raise ValueError(f"experts {missing} have no replica on any rank")
    E, W = tokens_EW.shape
    capacity_EW = replica_capacity(tokens_EW.sum(axis=1), replicas_EW)
    kept_EW = np.minimum(tokens_EW, capacity_EW)
    counts_EWW = np.zeros((E, W, W), dtype=np.int64)
    counts_EWW[:, np.arange(W), np.arange(W)] = kept_EW
    leftover_EW = tokens_EW - kept_EW
    residual_EW = capacity_EW - kept_EW
    counts_EWW += _proportional_transport(leftover_EW, residual_EW)
    return counts_EWW


def _proportional_transport(supply_EW: np.ndarray, demand_EW: np.ndarray) -> np.ndarray:
    """Integer flows src -> dst with row sums = supply and column sums = demand, each within
    one of the proportional ideal supply_i * demand_j / total.

    Start from the ideal rounded down; rows and columns are then short by small integers,
    and the ideal's fractional parts show that some 0/1 top-up matrix with exactly those
    margins exists. Sender by sender (rank order), each takes its missing units from the
    receivers still short by the most (ties to the lowest rank). That greedy never gets
    stuck (Gale-Ryser: any feasible top-up can be swapped into one that uses, for this
    sender, the columns with the largest remaining shortfall), so every margin is exact.
    """
    E, W = supply_EW.shape
    total_E = supply_EW.sum(axis=1)
    assert (total_E == demand_EW.sum(axis=1)).all()
    # Integer arithmetic: every rank rounds identically.
    ideal_numer_EWW = supply_EW[:, :, None] * demand_EW[:, None, :]
    flows_EWW = ideal_numer_EWW // np.maximum(total_E, 1)[:, None, None]
    short_rows_EW = supply_EW - flows_EWW.sum(axis=2)
    short_cols_EW = demand_EW - flows_EWW.sum(axis=1)
    ranks_EW = np.broadcast_to(np.arange(W), (E, W))
    for src in range(W):
        order_EW = np.argsort(-short_cols_EW, axis=1, kind="stable")
        place_EW = np.empty_like(order_EW)
        np.put_along_axis(place_EW, order_EW, ranks_EW, axis=1)
        top_up_EW = (place_EW < short_rows_EW[:, src, None]).astype(np.int64)
        flows_EWW[:, src, :] += top_up_EW
        short_cols_EW -= top_up_EW
    assert (short_cols_EW == 0).all() and (flows_EWW >= 0).all()
    return flows_EWW
