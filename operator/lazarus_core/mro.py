"""MRO (maximum rank overlap): the placement that maximises model-level recovery.

The most fragile layer (the fewest replicas on its coldest experts) gets its recovery-best
anchors (``anchor_search.py``); that layer's cores then anchor every layer
(``anchors.py``), so the model's failure sets are those of one layer, and the free
replicas are placed to balance the ranks (``balance.py``). Replica counts are options too:
the allocation formula's, evened out, and, where none of those balances, the counts the
fill trades to (``count_trading.py``), each with a structure of its own; the choice goes
by recovery first, then ranks within 5% of the mean (``_Shape.template``).
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from .anchor_search import best_anchors, cores_key, largest_core, scored_failures
from .anchors import (LayerAnchors, align, anchor_greedily, anchored_replicas, balance_within,
                      repair, toward_holders)
from .allocation import even_out
from .balance import (BALANCE_TARGET, fill_counts, fill_layers, filled_balance, first_balanced,
                      layer_balance)
from .migration import fill_copies
from .placement import Placement
from .plan import split_slots
from .recovery import fatal_counts
from .recovery_search import SCORING_BUDGET

# Failure counts that decide between keeping the surviving cores and a fresh structure.
REPLAN_FAILURES = 2
# Rounds of replica counts proposed by the fill's trading, and the options (the best
# balanced first) that propose in each round (``_Shape.template``).
TRADE_ROUNDS = 3
PROPOSERS = 2
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
    weights = loads if loads is not None else [[1.0] * len(r) for r in layers]
    g = list(ranks_per_node) if ranks_per_node is not None else [1] * len(slots)
    _, placements = first_balanced(
        [lambda make=make: (None, place_anchored(make(), slots, weights, ranks_per_node, None,
                                                 trade=loads is not None))
         for make in structure(layers, slots, loads, ranks_per_node)], weights, g, slots)
    return [split_slots(row, slots) for row in placements]


def place_anchored(anchors: Sequence[LayerAnchors], slots: Sequence[int],
                   loads: Sequence[Sequence[float]], ranks_per_node: Sequence[int] | None,
                   references: Sequence[np.ndarray] | None, trade: bool = False) -> np.ndarray:
    """Each layer's free replicas placed around its anchors to balance the ranks, as
    [layer, slot] (``balance.fill_layers``); with ``trade``, a layer still out of balance
    trades replica counts (read them back from the placement).

    ``references[l][node, e]`` are the replicas a node already holds, kept where possible.
    """
    g = list(ranks_per_node) if ranks_per_node is not None else [1] * len(slots)
    weights = per_replica([a.replicas for a in anchors], loads)
    return fill_layers([a.replicas for a in anchors], anchored_replicas(anchors), weights,
                       g, [c // k for c, k in zip(slots, g)], references, trade)


def place_toward_holders(anchors: Sequence[LayerAnchors], slots: Sequence[int],
                         loads: Sequence[Sequence[float]], ranks_per_node: Sequence[int],
                         references: np.ndarray, trade: bool) -> np.ndarray:
    """``place_anchored`` of a fresh structure on a re-plan (``references[l][node, e]``:
    what the node now at each position holds): every layer filled as built and, where its
    experts trade equal cores towards the nodes that hold them (``anchors.toward_holders``),
    filled again so traded; the traded fill is kept where it copies no more replicas and
    its ranks stay within ``BALANCE_TARGET`` or no worse than as built."""
    weights = per_replica([a.replicas for a in anchors], loads).tolist()
    built = place_anchored(anchors, slots, loads, ranks_per_node, references, trade)
    nearer = [toward_holders(a, w, h, slots, BALANCE_TARGET)
              for a, w, h in zip(anchors, weights, references)]
    changed = [li for li, (a, b) in enumerate(zip(nearer, anchors)) if a != b]
    if not changed:
        return built
    # Only the layers whose anchors changed are filled again.
    layer_loads, held = [loads[li] for li in changed], np.asarray(references)[changed]
    traded = place_anchored([nearer[li] for li in changed], slots, layer_loads,
                            ranks_per_node, held, trade)
    g = list(ranks_per_node)
    per_rank = [c // k for c, k in zip(slots, g)]
    keep = ((fill_copies(traded, held, slots) <= fill_copies(built[changed], held, slots))
            & (layer_balance(traded, layer_loads, g, per_rank)
               <= np.maximum(layer_balance(built[changed], layer_loads, g, per_rank),
                             BALANCE_TARGET)))
    out = built.copy()
    out[np.asarray(changed)[keep]] = traded[keep]
    return out


def per_replica(replicas, loads) -> np.ndarray:
    """[layer, expert]: the load each replica carries, t_e / r_e (0 without replicas)."""
    r = np.asarray(replicas, dtype=np.float64)
    return np.divide(np.asarray(loads, dtype=np.float64), r, out=np.zeros_like(r), where=r > 0)


def structure(layers: Sequence[Sequence[int]], slots: Sequence[int],
              loads: Sequence[Sequence[float]] | None,
              ranks_per_node: Sequence[int] | None = None
              ) -> list[Callable[[], list[LayerAnchors]]]:
    """Every layer's replica counts and anchors, for a fresh plan: makers of the options as
    good on recovery as the best, the one to take first (``solver.layout`` takes the next
    where the first one's other layers do not balance as its most fragile layer does).

    With ``loads``, the allocation formula's counts are tried as given and evened out
    (``allocation.even_out``), and where neither balances, as the fill trades them
    (``_Shape.template``); the most fragile layer of each decides: its best anchors,
    aligned over all layers. The choice goes by fatal failure sets (within
    ``RECOVERY_TOLERANCE``), then ranks within ``balance.BALANCE_TARGET`` on the most
    fragile layer, then balance.
    """
    shape = _Shape(layers, slots, loads, ranks_per_node)
    shape.template()
    return [lambda index=index, weights=weights, probe=probe, template=template:
            align(shape.variants[index], template, slots, weights, weights[probe],
                  shape.largest)
            for index, weights, probe, template in shape.alternatives()]


def restructure(layers: Sequence[Sequence[int]], slots: Sequence[int],
                loads: Sequence[Sequence[float]] | None,
                ranks_per_node: Sequence[int] | None,
                previous: Sequence[Sequence[int]],
                holders: Sequence[Sequence[int]],
                before: Sequence[Sequence[int]]
                ) -> list[tuple[Callable[[], list[LayerAnchors]], bool]]:
    """Every layer's replica counts and anchors for a re-plan, and whether they are fresh
    (built on positions, to be assigned nodes: ``migration.map_anchors``) rather than
    repaired on the nodes themselves: the options as good on recovery as the best, as
    makers, the one to take first (as ``structure``'s).

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
                and shape.balance_of(repaired[index][probe], probe) <= BALANCE_TARGET):
            return [(lambda kept=repaired[index]: kept, False)]
    index, weights, probe, template = shape.template()
    replicas = shape.variants[index]
    if index not in repaired:  # counts the fill traded to (``_Shape.template``)
        repaired[index] = repair(replicas, weights, previous, holders, slots, shape.largest)
    kept = repaired[index]

    def dealt() -> list[LayerAnchors]:
        return [balance_within(a, w, n) for a, w in zip(kept, weights)]

    def fresh(index, weights, probe, template):
        return lambda: align(shape.variants[index], template, slots, weights, weights[probe],
                             shape.largest)

    # Aligning adds cores to the template's, so the template's counts stand for fresh
    # anchors' until they are needed.
    key = model_key(kept, n, REPLAN_FAILURES)
    options = [
        (key, 0, lambda: shape.balance_of(kept[probe], probe), (lambda: kept, False)),
        (key, 1, lambda: shape.balance_of(balance_within(kept[probe], weights[probe], n),
                                          probe), (dealt, False))]
    for choice in shape.alternatives():
        options.append((cores_key(choice[3], n, shape.k), 2,
                        lambda choice=choice: shape.balance_of(choice[3], choice[2]),
                        (fresh(*choice), True)))
    return _ranked(options, n, REPLAN_FAILURES)


class _Shape:
    """What ``structure`` and ``restructure`` weigh: the replica-count variants, their
    per-replica loads and most fragile layer, and the balance a layer's anchors give."""

    def __init__(self, layers, slots, loads, ranks_per_node):
        self.variants = [[list(r) for r in layers]]
        # Counts are traded for measured loads only (without, they are taken as given).
        self.trade = loads is not None
        if loads is None:
            loads = [[1.0] * len(r) for r in layers]
        else:
            traded = [even_out(r, t, len(slots)) for r, t in zip(layers, loads)]
            if traded != self.variants[0]:
                self.variants.append(traded)
        self.slots, self.loads, self.ranks_per_node = slots, loads, ranks_per_node
        self.k = scored_failures(len(slots))
        self.largest = largest_core(len(slots))
        self.templates: dict[tuple[int, int], LayerAnchors] = {}  # see ``structure_of``
        self.weights: dict[int, tuple] = {}  # variant -> ``weighed``
        self.options: list[tuple] = []  # the last ``template``'s, for ``alternatives``

    def weighed_variant(self, index: int):
        """``weighed`` of variant ``index`` (computed once)."""
        if index not in self.weights:
            self.weights[index] = self.weighed(self.variants[index])
        return self.weights[index]

    def weighed(self, replicas):
        """Per-replica loads, and the most fragile layer (fewest replicas, coldest first)."""
        weights = per_replica(replicas, self.loads).tolist()
        probe = min(range(len(replicas)), key=lambda li: (sorted(replicas[li]), li))
        return weights, probe

    def balance_of(self, anchors: LayerAnchors, probe: int) -> float:
        """The busiest rank over the mean of the probe layer filled around ``anchors``
        (with the counts its fill trades to)."""
        return self.filled(anchors, probe, self.trade)[1]

    def filled(self, anchors: LayerAnchors, probe: int, trade: bool) -> tuple[list[int], float]:
        """The probe layer's counts after its fill around ``anchors`` and its busiest rank
        over the mean."""
        row = place_anchored([anchors], self.slots, [self.loads[probe]], self.ranks_per_node,
                             None, trade)
        g = list(self.ranks_per_node) if self.ranks_per_node is not None else [1] * len(self.slots)
        return (fill_counts(row, len(anchors.replicas))[0].tolist(),
                filled_balance(row, [self.loads[probe]], g,
                               [c // k for c, k in zip(self.slots, g)]))

    def structure_of(self, key: tuple[int, int]) -> LayerAnchors:
        """The probe layer's anchors of option ``key`` = (variant, sharing): the variant's
        recovery-best structure (sharing 0), or its greedy construction with no core
        anchoring more than ``sharing`` experts (``anchors.anchor_greedily``: the cold
        experts spread over more cores, which leaves their nodes room for heavier
        replicas and is an option only where it recovers as well)."""
        if key not in self.templates:
            index, sharing = key
            replicas = self.variants[index]
            weights, probe = self.weighed_variant(index)
            if sharing:
                anchors = anchor_greedily(replicas[probe], weights[probe], [], self.slots,
                                          self.largest, sharing)
            else:
                anchors = balance_within(best_anchors(replicas[probe], self.slots,
                                                      weights[probe]),
                                         weights[probe], len(self.slots))
            self.templates[key] = anchors
        return self.templates[key]

    def option(self, key: tuple[int, int], trade: bool):
        """Option ``key`` for ``_ranked``, and whether its fill trades counts (with
        ``trade``)."""
        replicas = self.variants[key[0]]
        weights, probe = self.weighed_variant(key[0])
        template = self.structure_of(key)
        counts, balance = self.filled(template, probe, trade)
        return ((cores_key(template, len(self.slots), self.k), 0, balance,
                 (key, weights, probe, template)), counts != list(replicas[probe]))

    def traded(self, key: tuple[int, int]) -> list[int]:
        """The counts a fill of every layer around option ``key``'s anchors trades its way
        to (``count_trading.py``), as variants, with two that often balance better when
        given structures of their own: the same counts dealt in load order (the hottest
        expert the most), and the most fragile layer's traded counts dealt to every layer
        by load rank (so that every layer takes its anchors). Their indexes, the first one
        what the fill ends at (a variant already there keeps its index)."""
        replicas = self.variants[key[0]]
        weights, probe = self.weighed_variant(key[0])
        anchors = align(replicas, self.structure_of(key), self.slots, weights, weights[probe],
                        self.largest)
        placed = place_anchored(anchors, self.slots, self.loads, self.ranks_per_node, None,
                                trade=True)
        num_experts = len(replicas[0])
        ends = fill_counts(placed, num_experts).tolist()
        by_rank = [ends[probe][e] for e in _by_load(self.loads[probe])]
        out = []
        for counts in (ends, [_dealt(sorted(r, reverse=True), t) for r, t in zip(ends, self.loads)],
                       [_dealt(by_rank, t) for t in self.loads]):
            if counts not in self.variants:
                self.variants.append(counts)
            out.append(self.variants.index(counts))
        return out

    def template(self):
        """The chosen variant's index, weights, most fragile layer and its anchors (their
        fill may trade counts: ``count_trading.py``).

        Options are each variant's recovery-best structure; where none as good on recovery
        as the best balances, also the shared-less constructions (an option as good on
        recovery as the best, by other means), and fills that trade counts. A fill that
        trades ends at counts of its own: each such set of counts gets its own
        recovery-best structure (with two more proposals: ``traded``), which may trade
        again. An option whose traded counts have a better structure than its own is
        dropped: a plan is always the best placement the search finds for the counts it
        ends with. Only options as good on recovery as the best propose, and only until
        one of those balances, the ``PROPOSERS`` best balanced of them in each round.
        """
        n = len(self.slots)
        # (variant, sharing) -> (option, whether its fill trades); options are (fatal
        # counts, moves, balance, what to return). Trading costs more than a fill: tried
        # only where no option as good on recovery as the best balances without.
        options = {(i, 0): self.option((i, 0), trade=False) for i in range(len(self.variants))}
        self.options = [o for o, _ in options.values()]
        if not self.trade or _settled(self.options, n):
            return _variant(_ranked(self.options, n)[0])
        for i in range(len(self.variants)):
            most = max(Counter(c for c in self.structure_of((i, 0)).cores if c).values(),
                       default=1)
            options.update({(i, s): self.option((i, s), trade=False)
                            for s in range(most - 1, 0, -1)})
        self.options = [o for o, _ in options.values()]
        if _settled(self.options, n):
            return _variant(_ranked(self.options, n)[0])
        # Only options as good on recovery as the best can be taken: only they are filled
        # again with trading (the others keep their untraded fill).
        best = min(o[0] for o, _ in options.values())
        options = {key: self.option(key, trade=True) if _within(o[0], best, n) else (o, t)
                   for key, (o, t) in options.items()}
        ends: dict[tuple[int, int], tuple[int, int]] = {}

        def explore(key: tuple[int, int]) -> None:
            proposed = self.traded(key)
            ends[key] = (proposed[0], 0)
            for j in proposed:
                if (j, 0) not in options:
                    options[(j, 0)] = self.option((j, 0), trade=True)

        def valid() -> dict[tuple[int, int], tuple]:
            return {k: o for k, (o, _) in options.items()
                    if k not in ends or not _better_key(options[ends[k]][0][0], o[0], n)}

        for _ in range(TRADE_ROUNDS):
            choices = valid()
            if _settled(list(choices.values()), n):
                break
            best = min(o[0] for o in choices.values())
            pending = sorted((k for k, o in choices.items()
                              if _within(o[0], best, n) and options[k][1] and k not in ends),
                             key=lambda k: choices[k][2])
            if not pending:
                break
            for k in pending[:PROPOSERS]:
                explore(k)
        # The option taken must be checked too, if its fill trades.
        for _ in range(TRADE_ROUNDS):
            self.options = list(valid().values())
            choice = _ranked(self.options, n)[0]
            if not options[choice[0]][1] or choice[0] in ends:
                return _variant(choice)
            explore(choice[0])
        checked = [o for k, o in valid().items() if not options[k][1] or k in ends]
        self.options = checked or list(valid().values())
        return _variant(_ranked(self.options, n)[0])

    def alternatives(self) -> list[tuple]:
        """Every option of the last ``template`` as good on recovery as the best, in the
        order it would take them (its choice first)."""
        return [_variant(value) for value in _ranked(self.options, len(self.slots))]


def _variant(choice):
    """A chosen option's value with its variant's index in place of its key."""
    (index, _), weights, probe, template = choice
    return index, weights, probe, template


def _settled(options, num_nodes: int) -> bool:
    """Whether an option as good on recovery as the best has ranks within the target."""
    best = min(o[0] for o in options)
    return any(o[2] <= BALANCE_TARGET for o in options if _within(o[0], best, num_nodes))


def _better_key(key: Sequence[int], other: Sequence[int], num_nodes: int) -> bool:
    """Fewer fatal sets than ``other`` (lexicographically), beyond ``RECOVERY_TOLERANCE``."""
    return key < other and not _within(key, other, num_nodes)


def _by_load(loads: Sequence[float]) -> list[int]:
    """Experts from the most loaded to the least (ties by expert id)."""
    return sorted(range(len(loads)), key=lambda e: (-loads[e], e))


def _dealt(counts_by_rank: Sequence[int], loads: Sequence[float]) -> list[int]:
    """Counts given by load rank (the first to the most loaded expert), per expert."""
    out = [0] * len(loads)
    for e, count in zip(_by_load(loads), counts_by_rank):
        out[e] = count
    return out


def _ranked(options, num_nodes: int, depth: int | None = None) -> list:
    """The values of every option as good on recovery as the best (fatal counts within
    ``RECOVERY_TOLERANCE``, only the first ``depth`` failure counts when given), in the
    order to take them: ranks within ``BALANCE_TARGET`` first, then moving less, then
    balance. A balance may be a function that measures it. The first is the choice; the
    rest are what to fall back on where its other layers do not balance as its most
    fragile layer does."""
    options = [(o[0][:depth], *o[1:]) for o in options]
    best = min(o[0] for o in options)
    scored = []
    for i, (key, moves, balance, value) in enumerate(options):
        if _within(key, best, num_nodes):
            worst = balance() if callable(balance) else balance
            scored.append((max(worst, BALANCE_TARGET), moves, worst, i, value))
    return [o[4] for o in sorted(scored, key=lambda o: o[:4])]


def _within(key: Sequence[int], best: Sequence[int], num_nodes: int) -> bool:
    return all(abs(a - b) <= RECOVERY_TOLERANCE * math.comb(num_nodes, k)
               for k, (a, b) in enumerate(zip(key, best), start=1))


def model_key(anchors: Sequence[LayerAnchors], num_nodes: int, k: int) -> tuple[int, ...]:
    """Fatal failure sets for k = 1..k of the whole model's cores (lower is better)."""
    cores = {c for a in anchors for c in a.cores if c}
    return tuple(fatal_counts(cores, num_nodes, k, SCORING_BUDGET))
