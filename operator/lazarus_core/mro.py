"""MRO (maximum rank overlap): the placement that maximises model-level recovery.

With E ≤ c every node can hold one replica of every expert, and nesting each expert's
replicas on a prefix of the node order is optimal: any placement has an expert on at most
min_e min(r_e, N) distinct nodes, and nesting makes that one prefix the only set whose loss
is fatal. With E > c no single node set can hold all experts; the paper's grouping is one
heuristic among several. We build the candidate groupings, score each by its exact
recovery, and keep the best one that is at least as good as spread and compact at every
failure count scored.

Scoring runs on the most fragile layer only: layers share one grouping, so the model's
failure sets are those of its layer with the fewest replicas on its cold experts.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from .placement import Grouping, Placement, compact, nested_groups, spread
from .recovery import recovery_curve

# Failure counts the candidates are compared at, and the exact-counting work each score may
# spend (set unions): beyond it a candidate's curve stops and comparisons use the shorter one.
SCORED_FAILURES = 6
_SCORING_BUDGET = 30_000


def mro(layers: Sequence[Sequence[int]], slots: Sequence[int]) -> list[Placement]:
    num_experts = len(layers[0])
    min_slots = min(slots)
    if num_experts <= min_slots:
        grouping = Grouping.build(layers, slots, [num_experts])
        return [nested_groups(r, slots, grouping) for r in layers]

    probe = min(layers, key=lambda r: sorted(r))
    max_failures = min(SCORED_FAILURES, len(slots) - 1)

    def score(placement: Placement) -> tuple[float, ...]:
        return tuple(r.probability
                     for r in recovery_curve([placement], max_failures, exact_only=True,
                                             budget=_SCORING_BUDGET))

    baselines = [score(spread(probe, slots)), score(compact(probe, slots))]
    candidates = [(score(spread(probe, slots)), 0, None)]
    for i, sizes in enumerate(_group_sizes(num_experts, min_slots, len(slots)), start=1):
        for nested in sorted({1, 2, len(sizes) - 1, len(sizes)} & set(range(1, len(sizes) + 1))):
            grouping = Grouping.build(layers, slots, sizes, nested)
            candidates.append((score(nested_groups(probe, slots, grouping)), i, grouping))

    # Compare only at the failure counts every candidate could count exactly.
    depth = min(len(s) for s in baselines + [c[0] for c in candidates])

    def at_least_baselines(s: tuple[float, ...]) -> bool:
        return all(a >= b - 1e-12 for base in baselines for a, b in zip(s[:depth], base))

    safe = [c for c in candidates if at_least_baselines(c[0])] or candidates
    _, _, grouping = max(safe, key=lambda c: (c[0][:depth], c[1] > 0))
    if grouping is None:
        return [spread(r, slots) for r in layers]
    return [nested_groups(r, slots, grouping) for r in layers]


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
