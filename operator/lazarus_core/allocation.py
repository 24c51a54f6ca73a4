"""Replica allocation: how many replicas each expert of one layer gets (paper §4.1).

Experts are visited from the least to the most loaded. Each takes its load's share of the
slots still free, but never fewer than ``min_replicas``:

    r_e = max(floor(t_e / Σ_{e'≥e} t_e' · (N·c − Σ_{e'<e} r_e')), f)

and the most loaded expert takes whatever is left, so Σ r_e = N·c exactly even when
floating-point shares would round a slot away.
"""
from __future__ import annotations

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
