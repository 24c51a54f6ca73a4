"""MRO (maximum rank overlap): the placement that maximises model-level recovery.

With E ≤ c every node can hold one replica of every expert, and nesting each expert's
replicas on a prefix of the node order is optimal: any placement has an expert on at most
min_e min(r_e, N) distinct nodes, and nesting makes that one prefix the only set whose loss
is fatal. With E > c no single node set can hold all experts; the paper's grouping is one
heuristic among several. We build the grouped nestings and the spread layout, score each by
its exact model-level recovery, and keep the best one that is at least as good as spread and
compact at every failure count.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from .placement import Placement, compact, nested_groups, spread
from .recovery import recovery_probability

# Failure counts the candidates are compared at. Beyond this, all layouts are ~equally bad.
_SCORED_FAILURES = 8


def mro(layers: Sequence[Sequence[int]], slots: Sequence[int]) -> list[Placement]:
    num_experts = len(layers[0])
    min_slots = min(slots)
    if num_experts <= min_slots:
        return nested_groups(layers, slots, [num_experts])

    candidates = [nested_groups(layers, slots, sizes, nested)
                  for sizes in _group_sizes(num_experts, min_slots, len(slots))
                  for nested in range(1, len(sizes) + 1)]
    baselines = [[spread(r, slots) for r in layers], [compact(r, slots) for r in layers]]
    ks = range(1, min(_SCORED_FAILURES, len(slots) - 1) + 1)

    def score(candidate):
        return tuple(recovery_probability(candidate, k).probability for k in ks)

    baseline_scores = [score(b) for b in baselines]
    scored = [(score(c), i, c) for i, c in enumerate(candidates + baselines[:1])]

    def dominates_baselines(s):
        return all(all(a >= b - 1e-12 for a, b in zip(s, base)) for base in baseline_scores)

    safe = [entry for entry in scored if dominates_baselines(entry[0])] or scored
    best = max(safe, key=lambda entry: (entry[0], -entry[1]))
    return best[2]


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
