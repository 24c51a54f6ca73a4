"""The most fragile layer's recovery-best anchors: constructions, then local search.

With E ≤ c every node can hold one replica of every expert, and nesting each expert's
replicas on a prefix of the node order is optimal: any placement has an expert on at most
min_e min(r_e, N) distinct nodes, and nesting makes that one prefix the only set whose loss
is fatal. With E > c no single node set can hold all experts; the paper's grouping is one
heuristic among several. We build the candidate groupings, score each by its exact fatal
failure sets, keep the best one that is at least as good as spread and compact at every
failure count scored, and improve it by local search (``recovery_search.py``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from .anchors import LayerAnchors, anchor_greedily, anchored_replicas, anchors_of
from .balance import fill_layers
from .placement import Grouping, Placement, compact, nested_groups, spread
from .plan import split_slots
from .recovery import BITMAP_NODES, fatal_counts
from .recovery_search import SCORING_BUDGET, improve, improve_anchors

# Failure counts compared beyond BITMAP_NODES nodes (on fewer, every count is compared).
SCORED_FAILURES = 6
# Largest cluster on which the paper's groupings, spread and compact are tried as
# constructions, and as the floor of the local search.
GROUPED_NODES = 32
# Layer shapes whose anchors are kept (``best_anchors``): about 10 KiB each at 256 experts,
# their loads most of it (2.6 KiB measured where the caller keeps the loads alive).
REMEMBERED_SHAPES = 256


def scored_failures(num_nodes: int) -> int:
    return num_nodes - 1 if num_nodes <= BITMAP_NODES else min(SCORED_FAILURES, num_nodes - 1)


def largest_core(num_nodes: int) -> int:
    """Cores beyond the failure counts scored change no score: anchor on no more nodes."""
    return num_nodes if num_nodes <= BITMAP_NODES else scored_failures(num_nodes) + 1


def best_anchors(replicas: Sequence[int], slots: Sequence[int],
                 weights: Sequence[float], search: bool = True) -> LayerAnchors:
    """One layer's recovery-best anchors: the best construction, then local search (without
    ``search``, the construction alone: what benchmarks/bench_solver.py measures the
    search against).

    Remembered for the last ``REMEMBERED_SHAPES`` shapes (the search is deterministic): a
    job's re-plans weigh the same shapes again and again, as a node is lost and its
    replacement joins (the simulator's default run asked 77 times for 15 shapes, a third
    of its time). ``forget_anchors`` empties it, for timing a plan cold."""
    return _best_anchors(tuple(replicas), tuple(slots), tuple(weights), search)


def forget_anchors() -> None:
    """Forget every remembered shape (``best_anchors``)."""
    _best_anchors.cache_clear()


@lru_cache(maxsize=REMEMBERED_SHAPES)
def _best_anchors(replicas: tuple[int, ...], slots: tuple[int, ...],
                  weights: tuple[float, ...], search: bool) -> LayerAnchors:
    num_experts = len(replicas)
    if num_experts <= min(slots):
        # Proven optimal: every expert nested on one prefix of the node order.
        return anchor_greedily(replicas, weights, [], slots, len(slots))
    k = scored_failures(len(slots))
    if k < 1:
        return _anchors_of(spread(replicas, slots), replicas)

    greedy = anchor_greedily(replicas, weights, [], slots, largest_core(len(slots)))
    if len(slots) > GROUPED_NODES:
        # Beyond GROUPED_NODES the paper's groupings, spread and compact never beat the
        # greedy construction in a sweep of 920 configurations (docs/placement.md), and
        # scoring each costs milliseconds.
        return improve_anchors(greedy, slots, k) if search else greedy
    placements = [spread(replicas, slots), fill_anchors(greedy, slots)]
    for sizes in _group_sizes(num_experts, min(slots), len(slots)):
        if len(sizes) > len(slots):
            continue  # each group needs a node of its own (a small node makes many groups)
        for nested in sorted({1, 2, len(sizes) - 1, len(sizes)} & set(range(1, len(sizes) + 1))):
            grouping = Grouping.build([replicas], slots, sizes, nested)
            placements.append(nested_groups(replicas, slots, grouping))
    candidates = [greedy if i == 1 else _anchors_of(p, replicas) for i, p in enumerate(placements)]
    scores = [cores_key(a, len(slots), k) for a in candidates]
    baselines = [scores[0], cores_key(_anchors_of(compact(replicas, slots), replicas),
                                      len(slots), k)]
    # Compare only at the failure counts every candidate could count exactly.
    depth = min(len(s) for s in scores + baselines)
    floor = [min(b[j] for b in baselines) for j in range(depth)]
    safe = [i for i, s in enumerate(scores) if all(a <= b for a, b in zip(s[:depth], floor))]
    ranked = sorted(safe or range(len(candidates)), key=lambda i: (scores[i][:depth], i == 0))
    if not search:
        return candidates[ranked[0]]
    if len(slots) > BITMAP_NODES:
        return improve_anchors(candidates[ranked[0]], slots, k, floor if safe else None)
    # Few nodes: swap whole replicas, from the best start and from the best grouping (the
    # two reach the exhaustive optimum on every instance the tests enumerate).
    starts = [ranked[0]] + [i for i in ranked[1:2] if i > 1]
    results = [improve([placements[i]], k, floor if safe else None)[0] for i in starts]
    return min((_anchors_of(p, replicas) for p in results),
               key=lambda a: cores_key(a, len(slots), k))


def fill_anchors(anchors: LayerAnchors, slots: Sequence[int]) -> Placement:
    """A placement with ``anchors``, free replicas dealt to balance equal-load experts."""
    weights = [[1.0 / r if r else 0.0 for r in anchors.replicas]]
    row = fill_layers([anchors.replicas], anchored_replicas([anchors]), weights,
                      [1] * len(slots), list(slots))[0]
    return split_slots(row, slots)


def cores_key(anchors: LayerAnchors, num_nodes: int, k: int) -> tuple[int, ...]:
    return tuple(fatal_counts({c for c in anchors.cores if c}, num_nodes, k, SCORING_BUDGET))


def _anchors_of(placement: Placement, replicas: Sequence[int]) -> LayerAnchors:
    return anchors_of([placement], [replicas])[0]


def _group_sizes(num_experts: int, per_node: int, num_nodes: int) -> list[list[int]]:
    """Ways to cut the popularity order into groups that each fit on one node.

    Full groups of the least popular experts (so the most fragile experts share one core),
    and even splits into the fewest groups and a couple more (so no group's node range is
    starved).
    """
    fewest = math.ceil(num_experts / per_node)
    full = [per_node] * (num_experts // per_node)
    if num_experts % per_node:
        full.append(num_experts % per_node)
    ways = [full]
    for groups in range(fewest, min(fewest + 2, num_nodes, num_experts) + 1):
        even = [num_experts // groups + (i < num_experts % groups) for i in range(groups)]
        even.reverse()  # the larger groups take the least popular experts
        if even not in ways:
            ways.append(even)
    return ways
