"""Replica allocation: how many replicas each expert of one layer gets (paper §4.1).

Experts are visited from the least to the most loaded. Each takes its load's share of the
slots still free, but never fewer than ``min_replicas``:

    r_e = max(floor(t_e / Σ_{e'≥e} t_e' · (N·c − Σ_{e'<e} r_e')), f)

and the most loaded expert takes whatever is left, so Σ r_e = N·c exactly even when
floating-point shares would round a slot away.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np


class InfeasibleError(ValueError):
    """The cluster has too few slots to give every expert ``min_replicas`` replicas."""


# A share that lands a hair under an integer (2.9999999999 for 3) must floor to that integer.
_FLOOR_SLACK = 1e-9


def allocate_replicas(loads: Sequence[float], total_slots: int, min_replicas: int) -> list[int]:
    """Replica count per expert (expert-id order) for one layer."""
    return allocate_many([loads], total_slots, min_replicas)[0]


def allocate_many(loads: Sequence[Sequence[float]], total_slots: int,
                  min_replicas: int) -> list[list[int]]:
    """``allocate_replicas`` for every layer at once: the formula walks the experts in
    order, so the layers go side by side (a re-plan of 58 layers x 256 experts spent 5 ms
    in a Python loop per layer). Same arithmetic, in the same order, as one layer at a
    time."""
    t = np.asarray(loads, dtype=np.float64)
    if t.ndim != 2 or t.shape[1] == 0:
        raise ValueError("experts: need at least one expert")
    num_layers, num_experts = t.shape
    if min_replicas < 1:
        raise ValueError(f"min_replicas: must be >= 1, got {min_replicas}")
    if total_slots < num_experts * min_replicas:
        raise InfeasibleError(
            f"slots: {total_slots} expert slots cannot hold {num_experts} experts x "
            f"{min_replicas} replicas = {num_experts * min_replicas}; add nodes or slots"
            + (f", or lower min_replicas to {total_slots // num_experts}"
               if total_slots >= num_experts else "")
        )
    if not (np.isfinite(t).all() and (t >= 0).all()):
        raise ValueError("loads: every expert load must be a finite number >= 0")
    t[t.sum(axis=1) <= 0] = 1.0  # no traffic measured yet: treat experts as equal

    order = np.argsort(t, axis=1, kind="stable")  # least loaded first, ties by expert id
    ranked = np.take_along_axis(t, order, axis=1)
    # suffix[:, i] = load of ranked[:, i:], summed from the small end (a running sum)
    suffix = np.cumsum(ranked[:, ::-1], axis=1)[:, ::-1]
    counts = np.empty((num_layers, num_experts), dtype=np.int64)
    free = np.full(num_layers, total_slots, dtype=np.int64)
    for i in range(num_experts - 1):
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(suffix[:, i] > 0, ranked[:, i] / suffix[:, i] * free, 0.0)
        r = np.maximum(np.floor(share + _FLOOR_SLACK).astype(np.int64), min_replicas)
        # Leave every expert still to come its minimum, whatever rounding did.
        r = np.minimum(r, free - (num_experts - 1 - i) * min_replicas)
        counts[:, i] = r
        free -= r
    counts[:, -1] = free
    replicas = np.empty_like(counts)
    np.put_along_axis(replicas, order, counts, axis=1)
    return replicas.tolist()


def even_out(replicas: Sequence[int], loads: Sequence[float], keep: int) -> list[int]:
    """Replica counts traded so that no replica carries much more load than the mean.

    The formula above floors every share and gives the rounding left over to the most
    loaded expert, so an expert whose share is 2.9 slots gets 2 replicas, each carrying
    1.45 times the mean. One replica at a time moves from the expert whose replicas would
    still carry the least load to the expert whose replicas carry the most, while that
    lowers the most. Donors keep at least ``keep`` replicas (a placement passes the
    number of nodes, so no donor's node set shrinks, or the layer's fewest where that
    trades too little: ``mro._evened``), every count stays at least what the formula gave
    or ``keep``, and more load still never gets fewer replicas.
    """
    r = list(replicas)
    if sum(loads) <= 0:
        return r
    # Receivers come off a max-heap of load per replica (ties: more load, then id), donors
    # off a min-heap of load per replica after giving one away (ties: less load, then id).
    # The levels traded at only fall on the receiving side and only rise on the giving
    # side, so no expert is ever on both: one that received would give back at the level
    # it received at, above any level still to come, and one that gave would receive at
    # the level it gave at, below any still to come. Each heap keeps only its own side's
    # entries up to date; the other side's entry of an expert never comes first while a
    # trade is still possible.
    gain = [(-t / n, -t, e) for e, (t, n) in enumerate(zip(loads, r)) if n]
    give = [(t / (n - 1), t, e) for e, (t, n) in enumerate(zip(loads, r)) if n > keep]
    heapq.heapify(gain)
    heapq.heapify(give)
    while give:
        neg, neg_load, x = gain[0]
        after, load, d = give[0]
        if after >= -neg:  # the donor would carry as much as the neediest: balanced
            break
        r[x] += 1
        r[d] -= 1
        heapq.heapreplace(gain, (neg_load / r[x], neg_load, x))
        if r[d] > keep:
            heapq.heapreplace(give, (load / (r[d] - 1), load, d))
        else:
            heapq.heappop(give)
    return r
