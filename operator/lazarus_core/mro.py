"""MRO (maximum rank overlap): the placement that maximises model-level recovery.

With E ≤ c every node can hold one replica of every expert, and nesting each expert's
replicas on a prefix of the node order is optimal: any placement has an expert on at most
min_e min(r_e, N) distinct nodes, and nesting makes that one prefix the only set whose loss
is fatal. With E > c no single node set can hold all experts; the paper's grouping is one
heuristic among several. We build the candidate groupings on the most fragile layer, score
each by its exact fatal failure sets, keep the best one that is at least as good as spread
and compact at every failure count scored, and improve it by local search
(``recovery_search.py``). That layer's cores then anchor every layer (``anchors.py``), so
the model's failure sets are those of one layer, and the free replicas are placed to
balance the ranks (``balance.py``).
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

from .anchors import (LayerAnchors, align, anchor_greedily, anchored_replicas, anchors_of,
                      balance_within, repair)
from .allocation import even_out
from .balance import BALANCE_TARGET, fill_layers, rank_loads
from .placement import Grouping, Placement, compact, nested_groups, spread
from .plan import replica_counts, split_slots
from .recovery import BITMAP_NODES, fatal_counts, masks_of
from .recovery_search import SCORING_BUDGET, improve, improve_anchors

# Failure counts compared beyond BITMAP_NODES nodes (on fewer, every count is compared).
SCORED_FAILURES = 6
# Largest cluster on which the paper's groupings, spread and compact are tried as
# constructions and as a floor.
GROUPED_NODES = 32
# Failure counts that decide between keeping the surviving cores and a fresh structure.
REPLAN_FAILURES = 2
# Recovery probabilities this close at every failure count are equal for choosing between
# replica counts and between fresh and repaired anchors: a failure model is not more
# precise. On up to BITMAP_NODES nodes one failure set is worth more than this.
RECOVERY_TOLERANCE = 1e-3


def mro(layers: Sequence[Sequence[int]], slots: Sequence[int],
        loads: Sequence[Sequence[float]] | None = None,
        ranks_per_node: Sequence[int] | None = None) -> list[Placement]:
    """MRO placement of every layer, balanced over ranks.

    ``loads[l][e]`` weighs each replica by t_e / r_e, and with them replica counts may be
    traded (read them back from the placement); without, loads are taken as equal and the
    counts are kept. ``ranks_per_node`` splits each node's slots over its ranks (one rank
    when absent).
    """
    anchors = structure(layers, slots, loads, ranks_per_node)
    weights = loads if loads is not None else [[1.0] * len(r) for r in layers]
    return [split_slots(row, slots)
            for row in place_anchored(anchors, slots, weights, ranks_per_node, None)]


def place_anchored(anchors: Sequence[LayerAnchors], slots: Sequence[int],
                   loads: Sequence[Sequence[float]], ranks_per_node: Sequence[int] | None,
                   references: Sequence[np.ndarray] | None) -> np.ndarray:
    """Each layer's free replicas placed around its anchors to balance the ranks, as
    [layer, slot] (``balance.fill_layers``).

    ``references[l][node, e]`` are the replicas a node already holds, kept where possible.
    """
    g = list(ranks_per_node) if ranks_per_node is not None else [1] * len(slots)
    weights = per_replica([a.replicas for a in anchors], loads)
    return fill_layers([a.replicas for a in anchors], anchored_replicas(anchors), weights,
                       g, [c // k for c, k in zip(slots, g)], references)


def per_replica(replicas, loads) -> np.ndarray:
    """[layer, expert]: the load each replica carries, t_e / r_e (0 without replicas)."""
    r = np.asarray(replicas, dtype=np.float64)
    return np.divide(np.asarray(loads, dtype=np.float64), r, out=np.zeros_like(r), where=r > 0)


def _fill_layer(anchors: LayerAnchors, slots, load, ranks_per_node, reference) -> Placement:
    return split_slots(place_anchored([anchors], slots, [load], ranks_per_node,
                                      None if reference is None else [reference])[0], slots)


def structure(layers: Sequence[Sequence[int]], slots: Sequence[int],
              loads: Sequence[Sequence[float]] | None,
              ranks_per_node: Sequence[int] | None = None,
              balance_first: bool = True) -> list[LayerAnchors]:
    """Every layer's replica counts and anchors, for a fresh plan.

    With ``loads``, the allocation formula's counts are tried as given and evened out
    (``allocation.even_out``), and the most fragile layer decides which: its best anchors,
    aligned over all layers. The choice goes by fatal failure sets (within
    ``RECOVERY_TOLERANCE``), then ranks within ``balance.BALANCE_TARGET`` on the most
    fragile layer, then balance. With ``balance_first``, anchors that give up fatal sets
    beyond one failed node for ranks within ``BALANCE_TARGET`` are options too, and come
    first (``_balanced_first``).
    """
    shape = _Shape(layers, slots, loads, ranks_per_node)
    index, weights, probe, template = shape.template(balance_first)
    return align(shape.variants[index], template, slots, weights, weights[probe],
                 shape.largest)


def restructure(layers: Sequence[Sequence[int]], slots: Sequence[int],
                loads: Sequence[Sequence[float]] | None,
                ranks_per_node: Sequence[int] | None,
                previous: Sequence[Sequence[int]],
                holders: Sequence[Sequence[int]],
                before: Sequence[Sequence[int]]) -> tuple[list[LayerAnchors], bool]:
    """Every layer's replica counts and anchors for a re-plan, and whether they are fresh
    (built on positions, to be assigned nodes: ``migration.map_anchors``) rather than
    repaired on the nodes themselves.

    ``previous`` is each (layer, expert)'s core in the plan before, as a mask of these node
    positions (0 where it did not survive); ``holders`` the nodes that hold each
    (layer, expert) now, masks alike; ``before`` the replica counts of the plan before.
    Repaired anchors keep experts on their cores, with new cores on nodes that hold the
    expert already, as they are and dealt anew within their cores; a fresh structure is
    ``structure``'s. A re-plan compares recovery at
    ``REPLAN_FAILURES`` only (the next loss brings the next re-plan, and a fresher structure
    that survives a few more sets of many simultaneous failures is not worth moving a
    quarter of the replicas), then ranks within ``BALANCE_TARGET``, then moving less, then
    balance.
    """
    shape = _Shape(layers, slots, loads, ranks_per_node)
    n = len(slots)
    # Repaired anchors with no fatal set at REPLAN_FAILURES and ranks within BALANCE_TARGET
    # cannot be beaten (fatal counts are never negative) and move least: the fresh
    # structures, most of a plan's time, are built only when no repair qualifies. The
    # variant whose counts change least from the plan before is repaired first (it moves
    # least), the other only when that one does not qualify.
    changed = [int(np.abs(np.asarray(replicas) - np.asarray(before)).sum())
               for replicas in shape.variants]
    repaired = {}
    for index in sorted(range(len(shape.variants)), key=changed.__getitem__):
        replicas = shape.variants[index]
        weights, probe = shape.weighed(replicas)
        repaired[index] = repair(replicas, weights, previous, holders, slots, shape.largest)
        if (not any(model_key(repaired[index], n, REPLAN_FAILURES))
                and shape.balance_of(repaired[index][probe], probe, weights) <= BALANCE_TARGET):
            return repaired[index], False
    index, weights, probe, template = shape.template(balance_first=True)
    replicas, kept = shape.variants[index], repaired[index]

    def dealt() -> list[LayerAnchors]:
        return [balance_within(a, w, n) for a, w in zip(kept, weights)]

    def fresh() -> list[LayerAnchors]:
        return align(replicas, template, slots, weights, weights[probe], shape.largest)

    # Aligning adds cores to the template's, so the template's counts stand for fresh
    # anchors' until they are needed.
    key = model_key(kept, n, REPLAN_FAILURES)
    choice = _choose([
        (key, 0, lambda: shape.balance_of(kept[probe], probe, weights), lambda: kept),
        (key, 1, lambda: shape.balance_of(balance_within(kept[probe], weights[probe], n),
                                          probe, weights), dealt),
        (cores_key(template, n, shape.k), 2,
         lambda: shape.balance_of(template, probe, weights), fresh),
    ], n, REPLAN_FAILURES)
    return choice(), choice is fresh


class _Shape:
    """What ``structure`` and ``restructure`` weigh: the replica-count variants, their
    per-replica loads and most fragile layer, and the balance a layer's anchors give."""

    def __init__(self, layers, slots, loads, ranks_per_node):
        self.variants = [[list(r) for r in layers]]
        if loads is None:
            loads = [[1.0] * len(r) for r in layers]
        else:
            traded = [even_out(r, t, len(slots)) for r, t in zip(layers, loads)]
            if traded != self.variants[0]:
                self.variants.append(traded)
        self.slots, self.loads, self.ranks_per_node = slots, loads, ranks_per_node
        self.k = scored_failures(len(slots))
        self.largest = largest_core(len(slots))

    def weighed(self, replicas):
        """Per-replica loads, and the most fragile layer (fewest replicas, coldest first)."""
        weights = per_replica(replicas, self.loads).tolist()
        probe = min(range(len(replicas)), key=lambda li: (sorted(replicas[li]), li))
        return weights, probe

    def balance_of(self, anchors: LayerAnchors, probe: int, weights) -> float:
        placement = _fill_layer(anchors, self.slots, self.loads[probe], self.ranks_per_node,
                                None)
        return _worst_rank(placement, weights[probe], self.slots, self.ranks_per_node)

    def template(self, balance_first: bool):
        """The chosen variant's index, weights, most fragile layer and its anchors."""
        n, k, slots = len(self.slots), self.k, self.slots
        counts = []  # (fatal counts, moves, balance, what to return)
        for index, replicas in enumerate(self.variants):
            weights, probe = self.weighed(replicas)
            template = balance_within(best_anchors(replicas[probe], slots, weights[probe]),
                                      weights[probe], n)
            counts.append((cores_key(template, n, k), 0,
                           self.balance_of(template, probe, weights),
                           (index, weights, probe, template)))
        # Recovery is traded for balance only when no variant's own structure balances:
        # the shared-less structures give up fatal sets by construction, and building them
        # with the paper's floor is most of a plan's time. (On the 108 settings of
        # docs/placement.md this changed three plans, each within 1.05 either way.)
        if balance_first and all(c[2] > BALANCE_TARGET for c in counts):
            floor = paper_key(self.variants[0], slots, k)
            for _, _, _, (index, weights, probe, template) in list(counts):
                for anchors in shared_less(template, slots, weights[probe], self.largest):
                    key = cores_key(anchors, n, k)
                    if all(a <= b for a, b in zip(key, floor)):
                        counts.append((key, 0, self.balance_of(anchors, probe, weights),
                                       (index, weights, probe, anchors)))
        return _choose(_balanced_first(counts, n), n)


def shared_less(template: LayerAnchors, slots: Sequence[int], weights: Sequence[float],
                largest: int) -> list[LayerAnchors]:
    """Structures that give up fatal sets for balance: the greedy construction with no core
    anchoring more than s experts, for every s below the most that ``template``'s cores
    anchor (the cold experts spread over more cores and leave their nodes room for heavier
    replicas, and the warmer experts anchor on unions of those cores)."""
    most = max(Counter(c for c in template.cores if c).values(), default=1)
    return [anchor_greedily(template.replicas, weights, [], slots, largest, sharing)
            for sharing in range(most - 1, 0, -1)]


def paper_key(layers: Sequence[Sequence[int]], slots: Sequence[int], k: int) -> tuple[int, ...]:
    """Fatal failure sets, k = 1..k, of the whole model placed as the paper's MRO places it
    (and this solver did before issue 18): the popularity grouping, or spread, that is best
    on the most fragile layer and no worse than spread and compact, nested on every layer.
    The floor under any recovery traded for balance."""
    n, num_experts = len(slots), len(layers[0])
    probe = min(layers, key=sorted)

    def key(placements: Sequence[Placement]) -> tuple[int, ...]:
        masks = masks_of(np.concatenate([replica_counts(p, num_experts).T > 0
                                         for p in placements]))
        return tuple(fatal_counts(masks, n, k, SCORING_BUDGET))

    if num_experts <= min(slots):
        groupings = [Grouping.build(layers, slots, [num_experts])]
    else:
        groupings = [Grouping.build(layers, slots, sizes, nested)
                     for sizes in _group_sizes(num_experts, min(slots), n)
                     if len(sizes) <= n
                     for nested in sorted({1, 2, len(sizes) - 1, len(sizes)}
                                          & set(range(1, len(sizes) + 1)))]
    candidates = [(key([nested_groups(probe, slots, g)]), 1, g) for g in groupings]
    if num_experts > min(slots):
        spread_key = key([spread(probe, slots)])
        candidates.append((spread_key, 0, None))
        floor = [min(a, b) for a, b in zip(spread_key, key([compact(probe, slots)]))]
        candidates = [c for c in candidates
                      if all(a <= b for a, b in zip(c[0], floor))] or candidates
    _, _, best = min(candidates, key=lambda c: (c[0], -c[1]))
    if best is None:
        return key([spread(r, slots) for r in layers])
    return key([nested_groups(r, slots, best) for r in layers])


def _balanced_first(options, num_nodes: int):
    """The options to choose among when balance is a constraint: those as good at one
    failed node as the best (within ``RECOVERY_TOLERANCE``), and of those only the ones
    with ranks within ``BALANCE_TARGET`` when any is. (Traded options never recover worse
    than ``paper_key`` at any failure count: ``structure`` leaves those out.)

    A rank 1.06 times the mean costs every step 6%; a second fatal pair among 45 costs 2.2
    points of recovery only when two nodes fail before a re-plan. Users asked for balance
    first (issue 18), but never at the price of surviving one failed node."""
    best = min(o[0][:1] for o in options)
    kept = [o for o in options if _within(o[0][:1], best, num_nodes)]
    balanced = [o for o in kept if o[2] <= BALANCE_TARGET]
    return balanced or kept


def _choose(options, num_nodes: int, depth: int | None = None):
    """The option to take: (fatal counts, moves, balance, value); balance may be a function
    that measures it, called in order of moving less and no further than needed. Only the
    first ``depth`` failure counts are compared, when given."""
    options = [(o[0][:depth], *o[1:]) for o in options]
    best = min(o[0] for o in options)
    close = sorted((o for o in options if _within(o[0], best, num_nodes)), key=lambda o: o[1])
    scored = []
    for _, moves, balance, value in close:
        if scored and scored[-1][1] < moves and scored[-1][0] <= BALANCE_TARGET:
            break
        worst = balance() if callable(balance) else balance
        scored.append((max(worst, BALANCE_TARGET), moves, worst, value))
    return min(scored, key=lambda o: o[:3])[3]


def _within(key: Sequence[int], best: Sequence[int], num_nodes: int) -> bool:
    return all(abs(a - b) <= RECOVERY_TOLERANCE * math.comb(num_nodes, k)
               for k, (a, b) in enumerate(zip(key, best), start=1))


def model_key(anchors: Sequence[LayerAnchors], num_nodes: int, k: int) -> tuple[int, ...]:
    """Fatal failure sets for k = 1..k of the whole model's cores (lower is better)."""
    cores = {c for a in anchors for c in a.cores if c}
    return tuple(fatal_counts(cores, num_nodes, k, SCORING_BUDGET))


def _worst_rank(placement, weights, slots, ranks_per_node) -> float:
    g = list(ranks_per_node) if ranks_per_node is not None else [1] * len(slots)
    loads = rank_loads(placement, weights, [c // k for c, k in zip(slots, g)])
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def scored_failures(num_nodes: int) -> int:
    return num_nodes - 1 if num_nodes <= BITMAP_NODES else min(SCORED_FAILURES, num_nodes - 1)


def largest_core(num_nodes: int) -> int:
    """Cores beyond the failure counts scored change no score: anchor on no more nodes."""
    return num_nodes if num_nodes <= BITMAP_NODES else scored_failures(num_nodes) + 1


def best_anchors(replicas: Sequence[int], slots: Sequence[int],
                 weights: Sequence[float], search: bool = True) -> LayerAnchors:
    """One layer's recovery-best anchors: the best construction, then local search (without
    ``search``, the construction alone: what benchmarks/bench_solver.py measures the
    search against)."""
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
    return _fill_layer(anchors, slots, [1.0] * len(anchors.replicas), None, None)


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
