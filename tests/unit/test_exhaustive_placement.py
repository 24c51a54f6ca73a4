"""MRO against every feasible placement of small instances.

Up to a renaming of nodes, a placement's recovery depends only on each node's set of
experts, so we enumerate multisets of N node-membership vectors (with duplicates of an
expert on one node allowed: they are the extra replicas Hall's condition must fit).
"""
import math
from itertools import combinations, combinations_with_replacement

import numpy as np
import pytest

from lazarus_core.allocation import allocate_replicas
from lazarus_core.mro import mro
from lazarus_core.recovery import recovery_probability


def _feasible(vectors, replicas, slots):
    """Can the replicas fill every slot with these node sets? (Hall's condition.)"""
    num_experts = len(replicas)
    extra = [r - sum((v >> e) & 1 for v in vectors) for e, r in enumerate(replicas)]
    room = [slots - v.bit_count() for v in vectors]
    if min(extra) < 0 or min(room) < 0 or sum(extra) != sum(room):
        return False
    for size in range(1, num_experts + 1):
        for group in combinations(range(num_experts), size):
            mask = sum(1 << e for e in group)
            reachable = sum(r for v, r in zip(vectors, room) if v & mask)
            if sum(extra[e] for e in group) > reachable:
                return False
    return True


def _recovery_by_k(vectors, num_experts):
    n = len(vectors)
    node_sets = [sum(1 << i for i, v in enumerate(vectors) if (v >> e) & 1)
                 for e in range(num_experts)]
    failed = np.arange(1 << n)
    dead = np.zeros(1 << n, dtype=bool)
    for s in node_sets:
        dead |= (failed & s) == s
    sizes = np.array([int(f).bit_count() for f in failed])
    return tuple(float((~dead & (sizes == k)).sum()) / math.comb(n, k) for k in range(1, n + 1))


def _all_recoveries(replicas, n, slots):
    e = len(replicas)
    vectors = [v for v in range(1, 1 << e) if v.bit_count() <= slots]
    return {
        _recovery_by_k(combo, e)
        for combo in combinations_with_replacement(vectors, n)
        if _feasible(combo, replicas, slots)
    }


INSTANCES = [
    # (nodes, slots, experts, min_replicas, zipf skew)
    (n, c, e, f, s)
    for n in (3, 4, 5, 6)
    for c in (1, 2, 3)
    for e in (2, 3, 4, 5)
    for f in (1, 2)
    for s in (0.0, 1.5)
    if e * f <= n * c and (e, n) != (5, 6) or (n, c, e, f, s) == (6, 2, 5, 2, 0.0)
]


@pytest.mark.parametrize("n,c,e,f,s", INSTANCES)
def test_mro_matches_exhaustive_optimum(n, c, e, f, s):
    replicas = allocate_replicas([1 / (i + 1) ** s for i in range(e)], n * c, f)
    ours = tuple(recovery_probability(mro([replicas], [c] * n), k).probability
                 for k in range(1, n + 1))
    everything = _all_recoveries(replicas, n, c)
    optimum = tuple(max(r[k] for r in everything) for k in range(n))
    # MRO is never beaten at every k by another placement (it is Pareto-optimal) ...
    assert not any(all(o >= m - 1e-9 for o, m in zip(r, ours))
                   and any(o > m + 1e-9 for o, m in zip(r, ours))
                   for r in everything), (replicas, ours)
    # ... and wherever one placement is best at every k at once, MRO is that placement.
    if optimum in everything:
        assert ours == pytest.approx(optimum), (replicas, ours, optimum)
