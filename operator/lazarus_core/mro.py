"""MRO (maximum rank overlap): the placement that maximises model-level recovery.

The most fragile layer (the fewest replicas on its coldest experts) gets its recovery-best
anchors (``anchor_search.py``); that layer's cores then anchor every layer
(``anchors.py``), so the model's failure sets are those of one layer, and the free
replicas are placed to balance the ranks (``balance.py``). Replica counts are options too:
the allocation formula's, evened out, and, where none of those balances, the counts the
fill trades to (``count_trading.py``), each with a structure of its own; the choice goes
by recovery first, then ranks within 5% of the mean (``_Shape.template``). Where that
choice does not balance, a second search adds one replica more at the least for every
expert and structures spread evenly over the nodes (``anchors.anchor_evenly``), and takes
what balances better, giving up a little recovery beyond two failures at most
(``RECOVERY_TRADE``).
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from .anchor_search import best_anchors, cores_key, largest_core, scored_failures
from .anchors import (LayerAnchors, align, anchor_evenly, anchor_greedily, anchored_replicas,
                      balance_within, repair, repair_evenly, toward_holders)
from .allocation import allocate_many, even_out, filling_cores
from .balance import (BALANCE_TARGET, BALANCED_ENOUGH, FILLS_TRIED, fill_counts, fill_layers,
                      filled_balance, first_balanced, layer_balance, traded_on)
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
# Beyond REPLAN_FAILURES nodes lost at once, a fresh plan whose ranks balance better may
# recover up to this much less than the best (never less than MRO alone: the formula's
# counts on their recovery-best structure) where nothing that recovers as well balances
# (``_Shape.template``'s second search, with its counts spread evenly): a rank
# 25% over the mean costs a quarter of every step, while three or more nodes must fail
# before the next re-plan (seconds) for the difference to count. No failure set of k >
# REPLAN_FAILURES on up to 6 nodes is worth this little (1 of C(6, 3) = 0.05), so small
# clusters keep their recovery-best placement.
RECOVERY_TRADE = 0.04
# ``_Shape`` option key (variant, sharing) of the evenly spread structure
# (``anchors.anchor_evenly``); sharing 0 is the recovery-best, > 0 a shared-less one.
EVEN = -1


def mro(layers: Sequence[Sequence[int]], slots: Sequence[int],
        loads: Sequence[Sequence[float]] | None = None,
        ranks_per_node: Sequence[int] | None = None) -> list[Placement]:
    """MRO placement of every layer, balanced over ranks.

    ``loads[l][e]`` weighs each replica by t_e / r_e, and with them replica counts may be
    traded (read them back from the placement); without, loads are taken as equal and the
    counts are kept. ``ranks_per_node`` splits each node's slots over its ranks (one rank
    when absent).
    """
    return [split_slots(row, slots) for row in filled(layers, slots, loads, ranks_per_node)]


def filled(layers: Sequence[Sequence[int]], slots: Sequence[int],
           loads: Sequence[Sequence[float]] | None,
           ranks_per_node: Sequence[int] | None) -> np.ndarray:
    """A fresh plan's [layer, slot] fill: ``structure``'s options filled in turn
    (``balance.first_balanced``), with the first search's choice as the rescue; with
    ``loads``, its layers still over the target trade on (``balance.traded_on``)."""
    weights = loads if loads is not None else [[1.0] * len(r) for r in layers]
    g = list(ranks_per_node) if ranks_per_node is not None else [1] * len(slots)

    def fill(make):
        def made():
            anchors = make()
            return anchors, place_anchored(anchors, slots, weights, ranks_per_node, None,
                                           trade=loads is not None)
        return made

    makers, rescue = structure(layers, slots, loads, ranks_per_node)
    anchors, placements = first_balanced([fill(make) for make in makers], weights, g, slots,
                                         fresh=True, rescues=[fill(rescue)] if rescue else [])
    if loads is None:
        return placements
    return traded_on(placements, anchored_replicas(anchors), loads, g,
                     [c // k for c, k in zip(slots, g)], largest_core(len(slots)))


def place_anchored(anchors: Sequence[LayerAnchors], slots: Sequence[int],
                   loads: Sequence[Sequence[float]], ranks_per_node: Sequence[int] | None,
                   references: Sequence[np.ndarray] | None, trade: bool = False,
                   alone: bool = False) -> np.ndarray:
    """Each layer's free replicas placed around its anchors to balance the ranks, as
    [layer, slot] (``balance.fill_layers``); with ``trade``, a layer still out of balance
    trades replica counts (read them back from the placement), with ``alone`` as much as a
    lone layer may.

    ``references[l][node, e]`` are the replicas a node already holds, kept where possible.
    """
    g = list(ranks_per_node) if ranks_per_node is not None else [1] * len(slots)
    weights = per_replica([a.replicas for a in anchors], loads)
    return fill_layers([a.replicas for a in anchors], anchored_replicas(anchors), weights,
                       g, [c // k for c, k in zip(slots, g)], references, trade, alone)


def place_toward_holders(anchors: Sequence[LayerAnchors], slots: Sequence[int],
                         loads: Sequence[Sequence[float]], ranks_per_node: Sequence[int],
                         references: np.ndarray, trade: bool, alone: bool = False
                         ) -> np.ndarray:
    """``place_anchored`` of a fresh structure on a re-plan (``references[l][node, e]``:
    what the node now at each position holds): every layer filled as built and, where its
    experts trade equal cores towards the nodes that hold them (``anchors.toward_holders``),
    filled again so traded; the traded fill is kept where it copies no more replicas and
    its ranks stay within ``BALANCE_TARGET`` or no worse than as built."""
    weights = per_replica([a.replicas for a in anchors], loads).tolist()
    built = place_anchored(anchors, slots, loads, ranks_per_node, references, trade, alone)
    nearer = [toward_holders(a, w, h, slots, BALANCE_TARGET)
              for a, w, h in zip(anchors, weights, references)]
    changed = [li for li, (a, b) in enumerate(zip(nearer, anchors)) if a != b]
    if not changed:
        return built
    # Only the layers whose anchors changed are filled again.
    layer_loads, held = [loads[li] for li in changed], np.asarray(references)[changed]
    traded = place_anchored([nearer[li] for li in changed], slots, layer_loads,
                            ranks_per_node, held, trade, alone)
    g = list(ranks_per_node)
    per_rank = [c // k for c, k in zip(slots, g)]
    keep = ((fill_copies(traded, held, slots) <= fill_copies(built[changed], held, slots))
            & (layer_balance(traded, layer_loads, g, per_rank)
               <= np.maximum(layer_balance(built[changed], layer_loads, g, per_rank),
                             BALANCE_TARGET)))
    out = built.copy()
    out[np.asarray(changed)[keep]] = traded[keep]
    return out


def _evened(layers: Sequence[Sequence[int]], loads: Sequence[Sequence[float]],
            nodes: int) -> list[list[list[int]]]:
    """Every layer's counts evened out (``allocation.even_out``), donors keeping a replica
    per node so that no donor's node set shrinks; and where that runs out of donors in some
    layer (no expert there has more replicas than nodes: its loads spread over many
    experts) with a replica still carrying more than ``BALANCE_TARGET`` times the mean
    slot load, also every layer with donors keeping the layer's fewest (1,024 GPUs, zipf
    0.4-1.0 per layer: the formula's counts left replicas at 1.15-1.18 times the mean and
    12 layers at 1.08-1.10). Each is a variant of its own: the search weighs recovery, and
    a structure for counts evened so far may recover less than what it would pick
    otherwise."""
    t = np.asarray(loads, dtype=np.float64)
    per_node = even_out(layers, t, nodes)
    counts = np.asarray(per_node)
    heavy = (per_replica(counts, t).max(axis=1)
             > BALANCE_TARGET * t.sum(axis=1) / counts.sum(axis=1))
    if not (heavy & (counts.max(axis=1) <= nodes)).any():
        return [per_node]
    return [per_node, even_out(layers, t, [min(r) for r in layers])]


def per_replica(replicas, loads) -> np.ndarray:
    """[layer, expert]: the load each replica carries, t_e / r_e (0 without replicas)."""
    r = np.asarray(replicas, dtype=np.float64)
    return np.divide(np.asarray(loads, dtype=np.float64), r, out=np.zeros_like(r), where=r > 0)


def structure(layers: Sequence[Sequence[int]], slots: Sequence[int],
              loads: Sequence[Sequence[float]] | None,
              ranks_per_node: Sequence[int] | None = None
              ) -> tuple[list[Callable[[], list[LayerAnchors]]],
                         Callable[[], list[LayerAnchors]] | None]:
    """Every layer's replica counts and anchors, for a fresh plan: makers of the options as
    good on recovery as the best, the one to take first (``filled`` takes the next where
    the first one's other layers do not balance as its most fragile layer does; their
    order weighs each on its heaviest layer too: ``_Shape.heavier``); and where
    the second search's choice was taken (``_Shape.template``), a maker of the first
    search's, to fill where none of those balances.

    Both searches weigh an option by its most fragile layer, which stands for every layer
    where layers differ only in which expert is hot. Where their loads differ in shape, an
    evenly spread structure can fill every layer far worse than its most fragile one: 768
    GPUs, zipf 1.2-1.8 differing per layer, the second search's options filled to 1.81
    (their most fragile layer 1.06), the first search's choice to 1.14 (EPLB-style 1.15).

    With ``loads``, the allocation formula's counts are tried as given and evened out
    (``allocation.even_out``), and where neither balances, as the fill trades them
    (``_Shape.template``); the most fragile layer of each decides: its best anchors,
    aligned over all layers. The choice goes by fatal failure sets (within
    ``RECOVERY_TOLERANCE``), then ranks within ``balance.BALANCE_TARGET`` on the most
    fragile layer, then balance.
    """
    shape = _Shape(layers, slots, loads, ranks_per_node, fresh=True)
    shape.template()

    def maker(index, weights, probe, template):
        return lambda: align(shape.variants[index], template, slots, weights, weights[probe],
                             shape.largest, shape.aligned)

    return ([maker(*choice) for choice in shape.alternatives(heavier=True)],
            shape.fallback and maker(*shape.fallback))


def restructure(layers: Sequence[Sequence[int]], slots: Sequence[int],
                loads: Sequence[Sequence[float]] | None,
                ranks_per_node: Sequence[int] | None,
                previous: Sequence[Sequence[int]],
                holders: Sequence[Sequence[int]],
                before: Sequence[Sequence[int]], spread: int | None = None
                ) -> tuple[list[tuple[Callable[[], list[LayerAnchors]], bool, float]],
                           list[tuple[Callable[[], list[LayerAnchors]], bool, float]]]:
    """Every layer's replica counts and anchors for a re-plan, whether they are fresh
    (built on positions, to be assigned nodes: ``migration.map_anchors``) rather than
    repaired on the nodes themselves, and the balance of their most fragile layer filled
    alone: the options as good on recovery as the best, as makers, the one to take first
    (as ``structure``'s); and the rescues, filled in turn after the window where none of it
    balances: the repair that moves least where the window leaves it out, then
    ``structure``'s rescue made afresh, and before it the repair that recovers as well and
    ranks first with it (``_ranked``), where that is another.

    ``previous`` is each (layer, expert)'s core in the plan before, as a mask of these node
    positions (0 where it did not survive); ``holders`` the nodes that hold each
    (layer, expert) now, masks alike; ``before`` the replica counts of the plan before;
    ``spread`` the size of its cores where it was spread evenly (``anchors.anchor_evenly``).
    Repaired anchors keep experts on their cores, with new cores on nodes that hold the
    expert already, as they are and dealt anew within their cores (a plan spread evenly
    keeps its floor of replicas and is repaired evenly: ``anchors.repair``); a fresh
    structure is ``structure``'s. A re-plan compares recovery at
    ``REPLAN_FAILURES`` only (the next loss brings the next re-plan, and a fresher structure
    that survives a few more sets of many simultaneous failures is not worth moving a
    quarter of the replicas), then ranks within ``BALANCE_TARGET``, then moving less, then
    balance. Every variant repaired is an option (not only the search's choice, whose
    counts are chosen for fresh structures: the 256-GPU benchmark plan re-planned after
    losing 4 of 32 nodes, 14,030 moved for 1.134, now 13,615 for 1.106); kept moves least,
    then dealt anew, then fresh, and between variants the one whose counts change less.
    """
    shape = _Shape(layers, slots, loads, ranks_per_node)
    n = len(slots)
    if spread is not None and spread > _floor(shape.variants[0]):
        shape.raised_floor()

    def mend(replicas, weights) -> list[LayerAnchors]:
        if spread is not None and _floor(replicas) >= spread:
            even = repair_evenly(replicas, weights, previous, holders, slots, spread)
            if even is not None:
                return even
        return repair(replicas, weights, previous, holders, slots, shape.largest)

    # Repaired anchors with no fatal set at REPLAN_FAILURES and ranks within BALANCE_TARGET
    # cannot be beaten (fatal counts are never negative) and move least: the fresh
    # structures, most of a plan's time, are built only when no repair qualifies. The
    # variant whose counts change least from the plan before is repaired first (it moves
    # least), the other only when that one does not qualify.
    def changed_from(replicas) -> int:
        return int(np.abs(np.asarray(replicas) - np.asarray(before)).sum())

    total = sum(map(sum, before))
    repaired = {}
    for index in sorted(range(len(shape.variants)),
                        key=lambda i: changed_from(shape.variants[i])):
        weights, probe = shape.weighed_variant(index)
        repaired[index] = mend(shape.variants[index], weights)
        if not any(model_key(repaired[index], n, REPLAN_FAILURES)):
            balance = shape.balance_of(repaired[index][probe], probe)
            if balance <= BALANCE_TARGET:
                return [(lambda kept=repaired[index]: kept, False, balance)], []
    index, weights, _, _ = shape.template(spread_only=spread is not None)
    if index not in repaired:  # counts the fill traded to (``_Shape.template``)
        repaired[index] = mend(shape.variants[index], weights)

    def fresh(index, weights, probe, template):
        return lambda: align(shape.variants[index], template, slots, weights, weights[probe],
                             shape.largest, shape.aligned)

    # Each option's most fragile layer balance, as ``_ranked`` measures it: what its fill
    # is held against (``balance.first_balanced``'s ``bounds``).
    measured: dict[int, float] = {}

    def measuring(key, moves, balance, value):
        """The option with its balance measured once, when first asked for."""
        def measure() -> float:
            if id(value) not in measured:
                measured[id(value)] = balance()
            return measured[id(value)]
        return key, moves, measure, value

    repairs = []
    for index, kept in repaired.items():
        weights, probe = shape.weighed_variant(index)
        key = model_key(kept, n, REPLAN_FAILURES)

        def dealt(kept=kept, weights=weights) -> list[LayerAnchors]:
            return [balance_within(a, w, n) for a, w in zip(kept, weights)]

        # Between balances alike, the counts that change less move fewer replicas.
        nearer = changed_from(shape.variants[index]) / (1 + total)
        repairs += [
            (key, nearer, lambda kept=kept, probe=probe: shape.balance_of(kept[probe], probe),
             (lambda kept=kept: kept, False)),
            (key, 1 + nearer, lambda kept=kept, weights=weights, probe=probe: shape.balance_of(
                balance_within(kept[probe], weights[probe], n), probe), (dealt, False))]
    # Aligning adds cores to the template's, so the template's counts stand for fresh
    # anchors' until they are needed.
    def fresh_option(choice):
        return (cores_key(choice[3], n, shape.k), 2,
                lambda: shape.balance_of(choice[3], choice[2]), (fresh(*choice), True))

    repairs = [measuring(*option) for option in repairs]
    options = repairs + [measuring(*fresh_option(c)) for c in shape.alternatives()]
    ranked = _ranked(options, n, REPLAN_FAILURES, near=spread is not None)
    rescues = []

    def rescue(value) -> None:
        """A rescue, unless the window or an earlier rescue fills it already."""
        if all(value is not v for v in ranked[:FILLS_TRIED] + rescues):
            rescues.append(value)

    # The repair that moves least is filled, if not in the window then as the first
    # rescue: the most fragile layers of variants of other counts are other layers, and
    # where loads differ in shape from layer to layer, one variant's may promise 1.04 and
    # fill every layer to 1.48 where the repair nearest the plan before fills to 1.11 (512
    # GPUs, zipf 0.9-1.5 per layer, after losing 4 nodes).
    least = min((o for o in repairs if any(o[3] is v for v in ranked)), key=lambda o: o[1],
                default=None)
    if least:
        rescue(least[3])
    if shape.fallback:
        # The repair that ranks first beside the first search's choice (as good on
        # recovery; then within BALANCE_TARGET, moving least) comes before it: where the
        # plan before was that choice, its repair moves a fraction of what the choice made
        # afresh does.
        fallback = measuring(*fresh_option(shape.fallback))
        value = fallback[3]
        fallback[2]()  # its bound, whether or not it ranks first
        rescue(_ranked([fallback] + repairs, n, REPLAN_FAILURES)[0])
        rescue(value)
    return ([(*value, measured[id(value)]) for value in ranked],
            [(*value, measured[id(value)]) for value in rescues])


class _Shape:
    """What ``structure`` and ``restructure`` weigh: the replica-count variants, their
    per-replica loads and most fragile layer, and the balance a layer's anchors give."""

    def __init__(self, layers, slots, loads, ranks_per_node, fresh: bool = False):
        self.variants = [[list(r) for r in layers]]
        self.fresh = fresh  # a fresh plan's (``cores_filled``), not a re-plan's
        # Counts are traded for measured loads only (without, they are taken as given).
        self.trade = loads is not None
        if loads is None:
            loads = [[1.0] * len(r) for r in layers]
        self.load_array = np.asarray(loads, dtype=np.float64)  # converted once
        if self.trade:
            for traded in _evened(layers, self.load_array, len(slots)):
                if traded not in self.variants:
                    self.variants.append(traded)
        self.slots, self.loads, self.ranks_per_node = slots, loads, ranks_per_node
        self.k = scored_failures(len(slots))
        self.largest = largest_core(len(slots))
        self.templates: dict[tuple[int, int], LayerAnchors] = {}  # see ``structure_of``
        self.aligned: dict[tuple, LayerAnchors] = {}  # ``anchors.align``'s memo
        self.weights: dict[int, tuple] = {}  # variant -> ``weighed``
        self.options: list[tuple] = []  # the last ``template``'s, for ``alternatives``
        self.reference: tuple[int, ...] | None = None  # see ``search``
        self.spreading = False  # see ``template``
        # The variants not made by trading (they get shared-less constructions).
        self.seeds = list(range(len(self.variants)))
        self.filled_options: dict[tuple, tuple] = {}  # (key, trade) -> ``option``
        self.traded_counts: dict[tuple[int, int], list[int]] = {}  # key -> ``traded``
        self.alike_layers: dict[int, bool] = {}  # variant -> ``uniform``
        self.heaviest_layers: dict[int, int | None] = {}  # variant -> ``heaviest``
        # The first search's choice, where ``template`` took the second's.
        self.fallback: tuple | None = None
        # The raised floor's variant (``raised_floor``): the second search's only.
        self.raised: int | None = None

    def weighed_variant(self, index: int):
        """``weighed`` of variant ``index`` (computed once)."""
        if index not in self.weights:
            self.weights[index] = self.weighed(self.variants[index])
        return self.weights[index]

    def weighed(self, replicas):
        """Per-replica loads, and the most fragile layer (fewest replicas, coldest first)."""
        counts = np.asarray(replicas, dtype=np.int64)
        weights = per_replica(counts, self.load_array).tolist()
        # The least of the layers' sorted counts, lexicographically, the first of equals:
        # its first count the primary key.
        fewest = np.sort(counts, axis=1)
        probe = int(np.lexsort(fewest.T[::-1])[0])
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
        return (fill_counts(row, len(anchors.replicas))[0].tolist(),
                self.busiest(row, [self.loads[probe]]))

    def busiest(self, placements: np.ndarray, loads) -> float:
        """The busiest rank over the mean of the layers ``placements`` fills ([layer, slot]),
        with ``loads`` theirs."""
        g = list(self.ranks_per_node) if self.ranks_per_node is not None else [1] * len(self.slots)
        return filled_balance(placements, loads, g, [c // k for c, k in zip(self.slots, g)])

    def structure_of(self, key: tuple[int, int]) -> LayerAnchors:
        """The probe layer's anchors of option ``key`` = (variant, sharing): the variant's
        recovery-best structure (sharing 0), or its greedy construction with no core
        anchoring more than ``sharing`` experts (``anchors.anchor_greedily``: the cold
        experts spread over more cores, which leaves their nodes room for heavier
        replicas and is an option only where it recovers as well), or with sharing
        ``EVEN`` spread evenly over the nodes (``anchors.anchor_evenly``; None where it
        does not apply)."""
        if key not in self.templates:
            index, sharing = key
            replicas = self.variants[index]
            weights, probe = self.weighed_variant(index)
            if sharing == EVEN:
                anchors = anchor_evenly(replicas[probe], weights[probe], self.slots)
            elif sharing:
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
        ``trade``); computed once (``template`` may search twice)."""
        if (key, trade) not in self.filled_options:
            self.filled_options[(key, trade)] = self.filled_option(key, trade)
        return self.filled_options[(key, trade)]

    def filled_option(self, key: tuple[int, int], trade: bool):
        """``option``, computed."""
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
        if key not in self.traded_counts:
            self.traded_counts[key] = self.trade_variants(key)
        return self.traded_counts[key]

    def trade_variants(self, key: tuple[int, int]) -> list[int]:
        """``traded``, computed."""
        replicas = self.variants[key[0]]
        _, probe = self.weighed_variant(key[0])
        placed = self.placed(key[0], self.structure_of(key))
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

    def raised_floor(self) -> None:
        """Add, as a variant, the allocation formula's counts with one replica more at the
        least (where the slots leave room for more): every expert then survives one
        failure more, and its coldest experts, spread evenly (``EVEN``), give every node
        its share of light replicas. The formula's f-replica cold experts, spread so, put
        a fatal set on every node; kept on few cores, they leave the other nodes only
        heavy replicas (the 256-GPU case of benchmarks/bench_solver.py)."""
        base = self.variants[0]
        floor = _floor(base) + 1
        total = sum(self.slots)
        if len(base[0]) * floor >= total:
            return
        raised = allocate_many(self.loads, total, floor)
        if raised not in self.variants:
            self.variants.append(raised)
            self.seeds.append(len(self.variants) - 1)
            self.raised = len(self.variants) - 1

    def template(self, spread_only: bool = False):
        """The chosen variant's index, weights, most fragile layer and its anchors (their
        fill may trade counts: ``count_trading.py``).

        First the options of ``search``; where the one taken does not balance, the search
        again with one replica more at the least (``raised_floor``) and every variant
        spread evenly (``EVEN``), under ``admissible``'s wider rule; its choice is taken
        where it balances better, or within ``BALANCED_ENOUGH`` of the first's and recovers
        better (448 GPUs, 58 layers of zipf 1: 1.0646 with no fatal pair of nodes against
        1.0640 with 4; the re-plan after losing 4 nodes, a spread plan's, then moved
        19,641 replicas against 50,167). With ``spread_only`` (a re-plan of a plan spread
        evenly, which the second search chose), the second search alone: 256 GPUs after
        losing 4 of 32 nodes, the same re-plans in a fifth less time.

        Before either search trades counts, the second search's first options are weighed
        (``spread_at_once``; where none balances, the best two also filled trading counts):
        one that balances and recovers better than the first search's first options is
        taken at once (128 nodes of 32 slots, E = 256, 58 layers of zipf 1.5: the first
        search traded for 3.5 s to reach 1.058, and then the second search's first
        options gave 1.0035 with no fatal pair; the plan now takes 0.15 s).
        """
        self.fallback = None
        if spread_only and self.trade:
            self.spreading = True
            self.raised_floor()
            return self.search()[0]
        if self.trade:
            at_once = self.spread_at_once()
            if at_once is not None:
                return at_once
        first, balance = self.search()
        if not self.trade or balance <= BALANCE_TARGET:
            return first
        searched = self.options
        self.spreading = True
        self.raised_floor()
        second, spread_balance = self.search()
        if spread_balance < balance or (spread_balance <= BALANCED_ENOUGH * balance
                                        and self.recovers_better(second, first)):
            self.fallback = first
            return second
        self.spreading, self.options = False, searched
        return first

    def recovers_better(self, choice, other) -> bool:
        """Whether ``choice``'s structure has no more fatal sets than ``other``'s at any
        failure count scored, and fewer at some (beyond ``RECOVERY_TOLERANCE``)."""
        n = len(self.slots)
        key, other_key = (cores_key(c[3], n, self.k) for c in (choice, other))
        return all(a <= b for a, b in zip(key, other_key)) and _better_key(key, other_key, n)

    def search(self) -> tuple[tuple, float]:
        """The choice among the options, and its most fragile layer's balance.

        Options are each variant's recovery-best structure (and, when ``spreading``, its
        even one); where none that can be taken balances, also the shared-less
        constructions of the variants not made by trading (an option as good on recovery
        as the best, by other means), and fills that trade counts. A fill that trades ends
        at counts of its own: each such set of counts gets its own recovery-best structure
        (with two more proposals:
        ``traded``), which may trade again. An option whose traded counts have a better
        structure than its own, one that ranks no worse on balance, is dropped: a plan is
        the best placement the search finds for the counts it ends with (an even one: the
        best even one). Where that structure balances worse, the option stays (dropped
        regardless, 16 nodes x 8 slots, E = 32, zipf 1: 1.074 with 3 fatal pairs of nodes
        where 1.006 with none was found; 256 GPUs re-planned after losing 2 of 32 nodes:
        1.32, its traded counts' structures at 2.2). Only options that
        can be taken propose, and only until one of those balances, the ``PROPOSERS``
        best balanced of them in each round. Before the first round, a fresh plan's first
        search weighs its choice's counts with the cold experts filling their cores, and
        takes them at once where the whole plan balances so (``cores_filled``).
        """
        n = len(self.slots)
        # (variant, sharing) -> (option, whether its fill trades); options are (fatal
        # counts, moves, balance, what to return). Trading costs more than a fill: tried
        # only where no option as good on recovery as the best balances without.
        options = self.untraded()
        self.options = [o for o, _ in options.values()]
        if not self.trade or self.settled(self.options):
            return self.pick()
        # Sharing less spreads the cold experts over more cores, and more cores make more
        # fatal sets: each variant's sharing stops at the first that cannot be taken (the
        # same plans, byte for byte, in 57 cases hashed; 8 nodes x 8 GPUs, E = 64, zipf
        # 1.0: 4.1 -> 2.1 s).
        best = min(o[0] for o, _ in options.values())
        for i in self.searched(self.seeds):
            most = max(Counter(c for c in self.structure_of((i, 0)).cores if c).values(),
                       default=1)
            for s in range(most - 1, 0, -1):
                options[(i, s)] = self.option((i, s), trade=False)
                if not self.admissible(options[(i, s)][0][0], best):
                    break
        self.options = [o for o, _ in options.values()]
        if self.settled(self.options):
            return self.pick()
        # Only options that can be taken are filled again with trading (the others keep
        # their untraded fill).
        best = min(o[0] for o, _ in options.values())
        options = {key: self.option(key, trade=True) if self.admissible(o[0], best) else (o, t)
                   for key, (o, t) in options.items()}
        if not self.settled([o for o, _ in options.values()]):
            at_once = self.cores_filled(options)
            if at_once is not None:
                options[at_once[0]] = at_once[1]
                self.options = [o for o, _ in options.values()]
                return self.pick()
        ends: dict[tuple[int, int], tuple[int, int]] = {}

        def explore(key: tuple[int, int]) -> None:
            made, ends[key] = self.proposals(key)
            for k, option in made.items():
                options.setdefault(k, option)

        def valid() -> dict[tuple[int, int], tuple]:
            return {k: o for k, (o, _) in options.items()
                    if k not in ends or not self.superseded(options[ends[k]][0], o)}

        for _ in range(TRADE_ROUNDS):
            choices = valid()
            if self.settled(list(choices.values())):
                break
            best = min(o[0] for o in choices.values())
            pending = sorted((k for k, o in choices.items()
                              if self.admissible(o[0], best) and options[k][1]
                              and k not in ends),
                             key=lambda k: choices[k][2])
            if not pending:
                break
            for k in pending[:PROPOSERS]:
                explore(k)
        # The option taken must be checked too, if its fill trades.
        for _ in range(TRADE_ROUNDS):
            self.options = list(valid().values())
            choice = self.ranked(self.options)[0]
            if not options[choice[0]][1] or choice[0] in ends:
                return self.pick()
            explore(choice[0])
        checked = [o for k, o in valid().items() if not options[k][1] or k in ends]
        self.options = checked or list(valid().values())
        return self.pick()

    def superseded(self, end, option) -> bool:
        """Whether the option that ``option``'s fill ends at (its traded counts' structure)
        recovers better and balances no worse: ``option`` then goes."""
        return (_better_key(end[0], option[0], len(self.slots))
                and max(end[2], BALANCE_TARGET) <= max(option[2], BALANCE_TARGET))

    def proposals(self, key: tuple[int, int]):
        """The options (filled trading counts) of the counts option ``key``'s fill
        proposes (``traded``), and the key of the one it ends at: an even option ends at
        its traded counts spread evenly, the others at their recovery-best structure."""
        proposed = self.traded(key)
        ways = (0, EVEN) if key[1] == EVEN else (0,)
        made = {(j, way): self.option((j, way), trade=True) for j in proposed for way in ways
                if self.structure_of((j, way)) is not None}
        end = (proposed[0], ways[-1]) if (proposed[0], ways[-1]) in made else (proposed[0], 0)
        return made, end

    def stands(self, key: tuple[int, int]) -> bool:
        """Whether option ``key``, the first of ``options`` and filled trading counts,
        stands as ``search`` checks the option it takes: the structures of the counts
        its fill proposes (``traded``) neither supersede it nor rank ahead of it. Where
        it does not stand, what finding out added is taken back (the variants, and what
        was computed of them), so that the searches then run as they would have."""
        kept = self.kept()
        option = self.option(key, trade=True)[0]
        made, end = self.proposals(key)
        if not self.superseded(made[end][0], option) and (
                self.ranked(self.options + [o for o, _ in made.values()])[0] is option[3]):
            return True
        self.take_back(kept)
        return False

    def kept(self) -> tuple:
        """What the searches have made so far (``take_back`` returns to it)."""
        return (len(self.variants), dict(self.templates), dict(self.weights),
                dict(self.filled_options), dict(self.traded_counts),
                dict(self.alike_layers), dict(self.heaviest_layers))

    def take_back(self, kept: tuple) -> None:
        """Forget what was made since ``kept``: the searches then run as they would have."""
        (count, self.templates, self.weights, self.filled_options, self.traded_counts,
         self.alike_layers, self.heaviest_layers) = kept
        del self.variants[count:]

    def cores_filled(self, options):
        """Where the first search's options do not balance once filled trading counts, the
        counts of its choice so far with the experts at the floor filling their cores
        (``allocation.filling_cores``), as (key, option): taken at once where that option
        recovers as well as the best (``admissible``), its most fragile layer filled
        without trading has ranks within ``BALANCE_TARGET``, and so has every layer of the
        plan filled around it (``place_anchored``, the fill ``filled`` makes of it: the
        only option within the target, it ranks first unless its heaviest layer filled
        alone does not balance, and ``first_balanced`` takes the first fill within the
        target). None otherwise, with what finding out added taken back, so that the
        search then runs as it would have.

        A fresh plan's only (a re-plan weighs what its options move, and fills the counts
        it repairs): 1,024 GPUs with per-layer zipf 0.8-1.4 loads, the search traded its
        way from 1.0565 to 1.0504 in 4.5 s (0 / 6 / 756 fatal sets of 1-3 nodes); these
        counts balance every layer at 1.0457 with the same fatal sets of 1 and 2 nodes,
        and the plan takes 0.4 s."""
        if not self.fresh or self.spreading or len(set(self.slots)) != 1:
            return None
        (index, _), *_ = self.ranked([o for o, _ in options.values()])[0]
        counts = filling_cores(self.variants[index], self.load_array, self.slots[0])
        if counts in self.variants:
            return None
        kept = self.kept()
        self.variants.append(counts)
        key = (len(self.variants) - 1, 0)
        option = self.option(key, trade=False)
        best = min(o[0] for o, _ in options.values())
        if (option[0][2] <= BALANCE_TARGET and self.admissible(option[0][0], best)
                and self.fills_within(option[0][3])):
            return key, option
        self.take_back(kept)
        return None

    def fills_within(self, value) -> bool:
        """Whether every layer of option ``value``'s plan, filled as ``filled`` fills it,
        has its ranks within ``BALANCE_TARGET``."""
        (index, _), _, _, template = value
        return self.busiest(self.placed(index, template), self.loads) <= BALANCE_TARGET

    def placed(self, index: int, template: LayerAnchors) -> np.ndarray:
        """Every layer of variant ``index`` aligned on ``template``'s cores and filled
        trading counts, [layer, slot] (as ``filled`` fills a plan's option)."""
        weights, probe = self.weighed_variant(index)
        anchors = align(self.variants[index], template, self.slots, weights, weights[probe],
                        self.largest, self.aligned)
        return place_anchored(anchors, self.slots, self.loads, self.ranks_per_node, None,
                              trade=True)

    def searched(self, indexes) -> list[int]:
        """The variants of ``indexes`` this search weighs: the raised floor's is the second
        search's only (``spreading``)."""
        return [i for i in indexes if self.spreading or i != self.raised]

    def untraded(self) -> dict[tuple[int, int], tuple]:
        """``search``'s first options: every variant's recovery-best structure (and, when
        ``spreading``, its even one), filled without trading."""
        variants = self.searched(range(len(self.variants)))
        options = {(i, 0): self.option((i, 0), trade=False) for i in variants}
        if self.reference is None:
            # What MRO alone gives: the formula's counts on their recovery-best structure.
            self.reference = options[(0, 0)][0][0]
        if self.spreading:
            options.update({(i, EVEN): self.option((i, EVEN), trade=False) for i in variants
                            if self.structure_of((i, EVEN)) is not None})
        return options

    def spread_at_once(self):
        """The second search's choice among its first options (``untraded``; where none
        balances as filled, the ``PROPOSERS`` best balanced of those that recover better
        filled again trading counts, one fill each, the one taken checked as ``search``
        checks its choice: ``stands``), where one balances and it recovers
        better than the first search's first options (no worse at any failure count,
        better at some): the plan is then within the target and
        recovers better than anything the first search starts from, and what both
        searches' trading would look for is balance, which it has. At equal recovery the
        first search goes on: its trading may balance better still (8 nodes x 8 slots,
        E = 16, zipf 0.5: 1.005 against the spread option's 1.014)."""
        first = [o for o, _ in self.untraded().values()]
        if self.settled(first):
            return None
        fallback = _variant(self.ranked(first)[0])
        self.spreading = True
        self.raised_floor()
        n = len(self.slots)
        best = min(o[0] for o in first)

        def better(template) -> bool:
            key = cores_key(template, n, self.k)
            return _within(tuple(map(min, key, best)), key, n) and _better_key(key, best, n)

        options = self.untraded()
        self.options = [o for o, _ in options.values()]
        if not self.settled(self.options) and self.trade:
            # 256 GPUs, the benchmark's loads: the first search traded for 1.2 s to
            # 1.19, and the second for 0.6 s more, to take the spread option that one
            # trading fill balances (1.0607 -> 1.0474); the plan now takes 0.24 s.
            ahead = min(o[0] for o in self.options)
            traded = sorted((k for k, (o, _) in options.items()
                             if self.admissible(o[0], ahead) and better(o[3][3])),
                            key=lambda k: options[k][0][2])[:PROPOSERS]
            self.options = [self.option(k, trade=True)[0] if k in traded else o
                            for k, (o, _) in options.items()]
        else:
            traded = []
        if self.settled(self.options):
            choice = self.ranked(self.options)[0]
            if better(choice[3]) and (choice[0] not in traded or self.stands(choice[0])):
                self.fallback = fallback
                return _variant(choice)
        self.spreading = False
        return None

    def pick(self) -> tuple[tuple, float]:
        """The first of ``ranked`` (as ``_variant``) and its balance."""
        choice = self.ranked(self.options)[0]
        return _variant(choice), next(o[2] for o in self.options if o[3] is choice)

    def alternatives(self, heavier: bool = False) -> list[tuple]:
        """Every option of the last ``template`` that can be taken, in the order it would
        take them (its choice first); with ``heavier`` (a fresh plan's order of fills),
        each weighed on its heaviest layer too where its most fragile layer balances
        (``heavier``)."""
        options = [(key, moves, self.heavier(balance, value) if heavier else balance, value)
                   for key, moves, balance, value in self.options]
        return [_variant(value) for value in self.ranked(options)]

    def heavier(self, balance: float, value):
        """An option's balance, or where its most fragile layer balances and another layer
        carries heavier replicas (``heaviest``), a measure of the larger of that and the
        heaviest layer's, filled as the plan fills it (trading counts), aligned on the
        option's cores.

        The search weighs options on their most fragile layer, which stands for every
        layer where layers differ only in which expert is hot; where they differ in shape,
        the layers a fill leaves out of balance are those whose replicas are heaviest
        (1,024 GPUs, per-layer zipf 0.4-1.0: the first option's most fragile layer filled
        to 1.023 and its 12 layers of replicas of 1.10-1.18 times the mean to 1.10, where
        the next option's filled every layer within 1.05), and filling every layer to find
        out takes a tenth of a second there. Only the order of the fills changes: the
        search itself weighs every option alike, on its most fragile layer."""
        (index, _), weights, probe, template = value
        heaviest = self.heaviest(index)
        if balance > BALANCE_TARGET or heaviest is None:
            return balance
        replicas = self.variants[index][heaviest]

        def measure() -> float:
            aligned = align([replicas], template, self.slots, [weights[heaviest]],
                            weights[probe], self.largest, self.aligned)[0]
            return max(balance, self.filled(aligned, heaviest, self.trade)[1])
        return measure

    def heaviest(self, index: int) -> int | None:
        """The layer of variant ``index`` whose heaviest replica carries the most over the
        layer's mean replica, where that is more than its most fragile layer's (None where
        not: layers alike in shape, rotated loads, have one ratio)."""
        if index not in self.heaviest_layers:
            counts = np.asarray(self.variants[index], dtype=np.float64)
            t = self.load_array
            ratio = per_replica(counts, t).max(axis=1) * counts.sum(axis=1) / t.sum(axis=1)
            _, probe = self.weighed_variant(index)
            layer = int(ratio.argmax())
            self.heaviest_layers[index] = (layer if ratio[layer] > ratio[probe] * (1 + 1e-9)
                                           else None)
        return self.heaviest_layers[index]

    def admissible(self, key: Sequence[int], best: Sequence[int]) -> bool:
        """Whether a fresh plan can take an option of fatal counts ``key``: as good on
        recovery as ``best`` (within ``RECOVERY_TOLERANCE``), or as good up to
        ``REPLAN_FAILURES``, within ``RECOVERY_TRADE`` of it beyond, and at every failure
        count as good as MRO alone (``reference``); ``ranked`` takes these only for a
        better balance."""
        n = len(self.slots)
        if _within(key, best, n):
            return True
        return self.spreading and (_within(key[:REPLAN_FAILURES], best[:REPLAN_FAILURES], n)
                and _within(tuple(map(min, key, self.reference)), key, n)
                and all(a - b <= RECOVERY_TRADE * math.comb(n, k)
                        for k, (a, b) in enumerate(zip(key, best), start=1)))

    def settled(self, options) -> bool:
        """Whether an option it can take has ranks within the target."""
        best = min(o[0] for o in options)
        return any(o[2] <= BALANCE_TARGET for o in options if self.admissible(o[0], best))

    def ranked(self, options) -> list:
        """``_ranked`` of a fresh plan's options, with those ``admissible`` lets in."""
        # Spreading, among options alike, those whose every layer has the most fragile
        # layer's counts first: every layer then takes its anchors (``anchors.align``),
        # so its balance stands for every layer's.
        return _ranked(options, len(self.slots), admissible=self.admissible,
                       prefer=self.uniform if self.spreading else None)

    def uniform(self, value) -> bool:
        """Whether every layer of the option's variant has its most fragile layer's counts,
        sorted (once per variant: ``ranked`` asks for every option each time)."""
        (index, _), _, probe, _ = value
        if index not in self.alike_layers:
            counts = self.variants[index]
            fragile = sorted(counts[probe])
            self.alike_layers[index] = all(sorted(layer) == fragile for layer in counts)
        return self.alike_layers[index]


def _variant(choice):
    """A chosen option's value with its variant's index in place of its key."""
    (index, _), weights, probe, template = choice
    return index, weights, probe, template


def _better_key(key: Sequence[int], other: Sequence[int], num_nodes: int) -> bool:
    """Fewer fatal sets than ``other`` (lexicographically), beyond ``RECOVERY_TOLERANCE``."""
    return key < other and not _within(key, other, num_nodes)


def _floor(layers: Sequence[Sequence[int]]) -> int:
    """The fewest replicas of any expert that has one, over all layers."""
    return min(min(r for r in layer if r) for layer in layers)


def _by_load(loads: Sequence[float]) -> list[int]:
    """Experts from the most loaded to the least (ties by expert id)."""
    return sorted(range(len(loads)), key=lambda e: (-loads[e], e))


def _dealt(counts_by_rank: Sequence[int], loads: Sequence[float]) -> list[int]:
    """Counts given by load rank (the first to the most loaded expert), per expert."""
    out = [0] * len(loads)
    for e, count in zip(_by_load(loads), counts_by_rank):
        out[e] = count
    return out


def _ranked(options, num_nodes: int, depth: int | None = None, admissible=None,
            near: bool = False, prefer=None) -> list:
    """The values of every option as good on recovery as the best (fatal counts within
    ``RECOVERY_TOLERANCE``, only the first ``depth`` failure counts when given), and of
    those ``admissible(key, best)`` lets in besides, in the order to take them: ranks
    within ``BALANCE_TARGET`` first, then moving less, then those as good as the best
    before the others (these by recovery), then those ``prefer(value)`` favours, then
    balance. A balance may be a function that measures it. The first is the choice; the
    rest are what to fall back on where its other layers do not balance as its most
    fragile layer does.

    A re-plan (``depth`` given) counts balances within ``BALANCED_ENOUGH`` of the best as
    alike, so that moving less decides between them (after losing one of 128 nodes, zipf
    1.5 loads: 18,328 replicas moved for 1.063 against 696 for 1.064). With ``near`` (a
    re-plan of a plan spread evenly), where none has ranks within ``BALANCE_TARGET``, only
    the options within ``BALANCE_TARGET`` times the best balance are taken, and of those
    only the kind that moves least (the integer part of moves: kept, dealt anew, fresh):
    rebuilding the structure to gain a few percent that still misses the target is not
    worth moving most of the replicas (after losing 4 of 32 nodes with 256 experts: 37,508
    moved for 1.085 against 13,168 for 1.088)."""
    options = [(o[0][:depth], *o[1:]) for o in options]
    best = min(o[0] for o in options)
    scored = []
    for i, (key, moves, balance, value) in enumerate(options):
        equal = _within(key, best, num_nodes)
        if equal or (admissible is not None and admissible(key, best)):
            worst = balance() if callable(balance) else balance
            favoured = prefer is None or prefer(value)
            scored.append((max(worst, BALANCE_TARGET), moves, (0,) if equal else (1, *key),
                           not favoured, worst, i, value))
    least = min(o[4] for o in scored)
    if near and least > BALANCE_TARGET:
        alike = [o for o in scored if o[4] <= BALANCE_TARGET * least]
        fewest = min(int(o[1]) for o in alike)
        scored = [o for o in alike if int(o[1]) == fewest]
    if depth is not None:
        floor = min(o[0] for o in scored)
        scored = [(floor if o[0] <= BALANCED_ENOUGH * floor else o[0], *o[1:]) for o in scored]
    return [o[6] for o in sorted(scored, key=lambda o: o[:6])]


def _within(key: Sequence[int], best: Sequence[int], num_nodes: int) -> bool:
    return all(abs(a - b) <= RECOVERY_TOLERANCE * math.comb(num_nodes, k)
               for k, (a, b) in enumerate(zip(key, best), start=1))


def model_key(anchors: Sequence[LayerAnchors], num_nodes: int, k: int) -> tuple[int, ...]:
    """Fatal failure sets for k = 1..k of the whole model's cores (lower is better)."""
    cores = {c for a in anchors for c in a.cores if c}
    return tuple(fatal_counts(cores, num_nodes, k, SCORING_BUDGET))
