"""MRO against the best of every feasible placement of small instances.

The instances are every N <= 6 nodes, c <= 3 slots per node, E = 2..c+3 experts and f in
{1, 2} that fit, with loads zipf 0, 0.5, 1, 1.5 and 2 and three random ones. For each, the
solver's plan (one layer) must recover exactly as well as the best placement of the replica
counts it chose (the curves k = 1..N-1 compared as a whole: the solver compares them
lexicographically, fewer fatal failure sets at the smallest k first), and where it traded
counts for balance, at every k at least as well as the best placement of the counts the
allocation formula gave.

The exhaustive search. Recovery depends only on each expert's node set, so a placement is
an expert x node incidence matrix with at most c experts per node and at most r_e nodes per
expert; replicas beyond the first on a node are duplicates, and the counts are feasible when
the duplicates fit the free slots of nodes that hold their expert (Hall's condition).
Permuting nodes, or experts with equal replica counts, changes nothing, so only matrices
whose columns are in lexicographic order, and whose rows are within each group of equal
counts, are enumerated: sorting rows and columns alternately reaches such a matrix from any
other and always makes the row-major string smaller, so it stops ("double lex").
"""
import math
import random
from itertools import combinations

import pytest

from lazarus_core.allocation import allocate_replicas
from lazarus_core.balance import BALANCE_TARGET
from lazarus_core.solver import plan_job
from lazarus_core.topology import NodeSpec


def _best_curve(replicas, n, c):
    """The lexicographically best recovery curve (k = 1..n-1) over every placement."""
    r = sorted(replicas)
    num = len(r)
    bit = [1 << (num - 1 - e) for e in range(num)]  # row 0 is the most significant bit
    columns = sorted(v for v in range(1, 1 << num) if v.bit_count() <= c)
    experts_in = {v: [e for e in range(num) if v & bit[e]] for v in columns}
    equal_rows = [(a, a + 1) for a in range(num - 1) if r[a] == r[a + 1]]
    supersets = [sum(1 << f for f in range(1 << n) if f & s == s) for s in range(1 << n)]
    of_size = [sum(1 << f for f in range(1 << n) if f.bit_count() == k) for k in range(n + 1)]
    seen, best = set(), [None]

    def fits(masks, cols):
        extra = [r[e] - masks[e].bit_count() for e in range(num)]
        room = [c - v.bit_count() for v in cols]
        needy = [e for e in range(num) if extra[e]]
        for size in range(1, len(needy) + 1):
            for group in combinations(needy, size):
                mask = sum(bit[e] for e in group)
                if sum(extra[e] for e in group) > sum(x for v, x in zip(cols, room) if v & mask):
                    return False
        return True

    def visit(start, depth, counts, tied, masks, cols):
        if depth == n:
            fatal = 0
            for m in masks:
                fatal |= supersets[m]
            if 0 in counts or fatal in seen:
                return
            if fits(masks, cols):
                seen.add(fatal)
                curve = tuple(1 - (fatal & of_size[k]).bit_count() / math.comb(n, k)
                              for k in range(1, n))
                best[0] = curve if best[0] is None else max(best[0], curve)
            return
        if counts.count(0) > (n - depth) * c:
            return
        for i in range(start, len(columns)):
            v = columns[i]
            members = experts_in[v]
            if any(counts[e] >= r[e] for e in members):
                continue
            still = []
            for (a, b), t in zip(equal_rows, tied):
                if t and v & bit[a] and not v & bit[b]:
                    break  # row a would exceed row b
                still.append(t and bool(v & bit[a]) == bool(v & bit[b]))
            else:
                for e in members:
                    counts[e] += 1
                    masks[e] |= 1 << depth
                visit(i, depth + 1, counts, still, masks, cols + [v])
                for e in members:
                    counts[e] -= 1
                    masks[e] &= ~(1 << depth)

    visit(0, 0, [0] * num, [True] * len(equal_rows), [0] * num, [])
    return best[0]


def _instances():
    rng = random.Random(18)
    out = {}
    for n in (3, 4, 5, 6):
        for c in (1, 2, 3):
            for e in range(2, c + 4):
                for f in (1, 2):
                    if e * f > n * c:
                        continue
                    loads = [[1 / (i + 1) ** s for i in range(e)] for s in (0, 0.5, 1, 1.5, 2)]
                    loads += [[rng.random() for _ in range(e)] for _ in range(3)]
                    for load in loads:
                        formula = tuple(allocate_replicas(load, n * c, f))
                        out.setdefault((n, c, f, tuple(sorted(formula))), (load, formula))
    return [pytest.param(n, c, f, load, formula, id=f"N{n}-c{c}-f{f}-{'.'.join(map(str, key))}",
                         marks=[pytest.mark.slow] if (n, c) == (6, 3) and len(key) >= 5 else [])
            for (n, c, f, key), (load, formula) in sorted(out.items())]


_BEST: dict = {}


def _best(replicas, n, c):
    key = (n, c, tuple(sorted(replicas)))
    if key not in _BEST:
        _BEST[key] = _best_curve(replicas, n, c)
    return _BEST[key]


@pytest.mark.parametrize("n,c,f,load,formula", _instances())
def test_mro_matches_the_exhaustive_optimum(n, c, f, load, formula):
    nodes = [NodeSpec(f"n{i}", 1, c) for i in range(n)]
    plan = plan_job(nodes, len(load), 1, f, "mro", loads=[load], max_failures=n - 1)
    placed = plan.layers[0].replicas
    curve = tuple(plan.recovery[str(k)] for k in range(1, n))
    # The plan is the best placement of the replica counts it chose...
    assert curve == pytest.approx(_best(placed, n, c)), (placed, curve)
    # ...and counts traded for balance never recover worse, at any k, than the best
    # placement of the counts the allocation formula gave.
    if tuple(placed) != formula:
        optimum = _best(formula, n, c)
        assert all(a >= b - 1e-9 for a, b in zip(curve, optimum)), (formula, placed, optimum,
                                                                   curve)
        assert all(r >= f for r in placed), placed


def _imbalance(plan, load) -> float:
    """max/mean expert load per node (one rank per node here): t_e / r_e per replica."""
    replicas = plan.layers[0].replicas
    per_node = [sum(load[e] / replicas[e] for e in slots) for slots in plan.layers[0].placement]
    return max(per_node) / (sum(per_node) / len(per_node))


@pytest.mark.parametrize("skew,f", [(0.5, 1), (0.5, 2), (1.0, 1)])
def test_the_reported_gap_is_closed_with_balanced_ranks(skew, f):
    # Issue 18: 4 nodes x 3 slots, 4 experts, zipf 0.5, f = 1 recovered 0.667 at k = 2
    # where a placement with the same counts (5, 3, 2, 2) recovers 0.833; the two other
    # instances here had the same gap. Recovering 0.833 forces the ranks to 1.11 times the
    # mean with those counts; traded counts, (3, 3, 4, 2) here, reach both.
    nodes = [NodeSpec(f"n{i}", 1, 3) for i in range(4)]
    load = [1 / (i + 1) ** skew for i in range(4)]
    plan = plan_job(nodes, 4, 1, f, "mro", loads=[load], max_failures=3)
    assert plan.recovery["2"] >= 0.8333 - 1e-9
    assert _imbalance(plan, load) <= BALANCE_TARGET
