"""Replica allocation: how many replicas each expert of one layer gets (paper §4.1).

Experts are visited from the least to the most loaded. Each takes its load's share of the
slots still free, but never fewer than ``min_replicas``:

    r_e = max(floor(t_e / Σ_{e'≥e} t_e' · (N·c − Σ_{e'<e} r_e')), f)

and the most loaded expert takes whatever is left, so Σ r_e = N·c exactly even when
floating-point shares would round a slot away.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Sequence


class InfeasibleError(ValueError):
    """The cluster has too few slots to give every expert ``min_replicas`` replicas."""


# A share that lands a hair under an integer (2.9999999999 for 3) must floor to that integer.
_FLOOR_SLACK = 1e-9


def allocate_replicas(loads: Sequence[float], total_slots: int, min_replicas: int) -> list[int]:
    """Replica count per expert (expert-id order) for one layer."""
    num_experts = len(loads)
    if num_experts == 0:
        raise ValueError("experts: need at least one expert")
    if min_replicas < 1:
        raise ValueError(f"min_replicas: must be >= 1, got {min_replicas}")
    if total_slots < num_experts * min_replicas:
        raise InfeasibleError(
            f"slots: {total_slots} expert slots cannot hold {num_experts} experts x "
            f"{min_replicas} replicas = {num_experts * min_replicas}; add nodes or slots"
            + (f", or lower min_replicas to {total_slots // num_experts}"
               if total_slots >= num_experts else "")
        )
    if any(not math.isfinite(t) or t < 0 for t in loads):
        raise ValueError("loads: every expert load must be a finite number >= 0")
    if sum(loads) <= 0:
        loads = [1.0] * num_experts  # no traffic measured yet: treat experts as equal

    order = sorted(range(num_experts), key=lambda e: (loads[e], e))
    # suffix[i] = load of order[i:], summed from the small end so it is as exact as floats allow
    suffix = [0.0] * (num_experts + 1)
    for i in range(num_experts - 1, -1, -1):
        suffix[i] = suffix[i + 1] + loads[order[i]]

    replicas = [0] * num_experts
    free = total_slots
    for i, e in enumerate(order[:-1]):
        share = loads[e] / suffix[i] * free if suffix[i] > 0 else 0.0
        r = max(math.floor(share + _FLOOR_SLACK), min_replicas)
        # Leave every expert still to come its minimum, whatever rounding did.
        r = min(r, free - (num_experts - 1 - i) * min_replicas)
        replicas[e] = r
        free -= r
    replicas[order[-1]] = free
    return replicas


def even_out(replicas: Sequence[int], loads: Sequence[float], keep: int) -> list[int]:
    """Replica counts traded so that no replica carries much more load than the mean.

    The formula above floors every share and gives the rounding left over to the most
    loaded expert, so an expert whose share is 2.9 slots gets 2 replicas, each carrying
    1.45 times the mean. One replica at a time moves from the expert whose replicas would
    still carry the least load to the expert whose replicas carry the most, while that
    lowers the most. Donors keep at least ``keep`` replicas (a placement passes the
    number of nodes, so no donor's node set shrinks), every count stays at least what the
    formula gave or ``keep``, and more load still never gets fewer replicas.
    """
    r = list(replicas)
    if sum(loads) <= 0:
        return r
    # Max-heap of load per replica; min-heap of load per replica after giving one away.
    # Ties go by load, then id, so experts that look alike are treated alike in any order.
    most = [(-t / n, -t, e) for e, (t, n) in enumerate(zip(loads, r)) if n]
    least = [(t / (n - 1), t, e) for e, (t, n) in enumerate(zip(loads, r)) if n > keep]
    heapq.heapify(most)
    heapq.heapify(least)
    while most and least:
        neg, _, x = most[0]
        if -neg != loads[x] / r[x]:
            heapq.heappop(most)  # stale
            continue
        after, _, d = least[0]
        if r[d] <= keep or after != loads[d] / (r[d] - 1):
            heapq.heappop(least)  # stale
            continue
        if d == x or after >= -neg:
            break
        r[x] += 1
        r[d] -= 1
        heapq.heapreplace(most, (-loads[x] / r[x], -loads[x], x))
        heapq.heappush(most, (-loads[d] / r[d], -loads[d], d))
        heapq.heappop(least)
        if r[d] > keep:
            heapq.heappush(least, (loads[d] / (r[d] - 1), loads[d], d))
        if r[x] > keep:
            heapq.heappush(least, (loads[x] / (r[x] - 1), loads[x], x))
    return r
