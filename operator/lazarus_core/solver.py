"""The placement solver: from nodes and expert loads to a validated plan, and re-plans."""
from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce

import numpy as np

from .allocation import allocate_many, measured_loads
from .anchors import anchors_of_presence, even_cover_masks, nodes_of
from .migration import (Migration, map_anchors, map_devices, map_nodes_optimal,
                        plan_transfers)
from .anchor_search import largest_core
from .balance import (BALANCE_TARGET, BALANCED_ENOUGH, MOVE_PRICE, busiest_rank,
                      fill_counts, cheapest, filled_balance, first_balanced)
from .carry import Carried, carry
from .count_trading import remembered
from .fewer_copies import with_fewer_copies
from .mro import (REPLAN_FAILURES, filled, mro, per_replica, place_anchored,
                  place_toward_holders, restructure)
from .placement import Placement, compact, spread
from .plan import POLICIES, LayerPlan, Plan, PlanNode, count_cube, validate
from .recovery import cube_presence, fatal_counts, masks_of, minimal_masks, recovery_table
from .swap_back import swapped_back
from .topology import NodeSpec, check_nodes, failure_domain_order

DEFAULT_MAX_FAILURES = 5

# Sizes the solver is built and measured for (benchmarks/bench_solver.py plans 4,096 GPUs,
# 512 nodes x 32 slots x 61 layers, in well under a second); past them a plan takes minutes
# or more memory than a controller has, so they are refused up front.
LIMITS = {"nodes": 4096, "slots": 1024, "experts": 1024, "layers": 512}
# Slots over all nodes and layers: twice the 4,096-GPU plan.
MAX_SLOT_ENTRIES = 1 << 21


def check_size(nodes: int, slots: int, experts: int, layers: int,
               names: dict[str, str] | None = None) -> None:
    """Refuse sizes beyond ``LIMITS`` with one message that names the field and the limit.

    ``slots`` is the most expert slots of any node; ``names`` maps the fields (nodes,
    slots, experts, layers) to what the caller calls them (a CLI flag, a spec field).
    """
    names = {**{k: k for k in LIMITS}, **(names or {})}
    given = {"nodes": nodes, "slots": slots, "experts": experts, "layers": layers}
    for field, limit in LIMITS.items():
        if given[field] > limit:
            raise ValueError(f"{names[field]}: at most {limit:,} (the most the solver is "
                             f"built for), got {given[field]:,}")
    if nodes * slots * layers > MAX_SLOT_ENTRIES:
        raise ValueError(f"{names['nodes']} x {names['slots']} x {names['layers']}: at most "
                         f"{MAX_SLOT_ENTRIES:,} expert slots over all nodes and layers (the "
                         f"most the solver is built for), got {nodes * slots * layers:,}")


def place(policy: str, layers: Sequence[Sequence[int]], slots: Sequence[int]) -> list[Placement]:
    """Placements for replica counts as given (MRO may trade a few; see ``layout``)."""
    if policy == "mro":
        return mro(layers, slots)
    if policy == "spread":
        return [spread(r, slots) for r in layers]
    if policy == "compact":
        return [compact(r, slots) for r in layers]
    raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {policy!r}")


def allocate_layers(loads: Sequence[Sequence[float]] | None, layers: int, experts: int,
                    total_slots: int, min_replicas: int) -> list[list[int]]:
    """Replica counts per layer (``loads`` already through ``checked_loads``)."""
    return allocate_many(_weights(loads, layers, experts), total_slots, min_replicas)


def _weights(loads: Sequence[Sequence[float]] | None, layers: int,
             experts: int) -> Sequence[Sequence[float]]:
    """``loads``, or equal loads where none were measured."""
    return loads if loads is not None else [[1.0] * experts] * layers


def checked_loads(loads: Sequence[Sequence[float]] | None, layers: int,
                  experts: int) -> Sequence[Sequence[float]] | None:
    """``loads`` as the solver takes them (``allocation.measured_loads``): the loads given,
    or where that changes some layer (no traffic yet, or loads scaled), a copy so changed
    (every step that weighs replicas then sees the same loads the allocation did)."""
    if loads is None:
        return None
    if len(loads) != layers or any(len(l) != experts for l in loads):
        raise ValueError(f"loads: need {layers} layers x {experts} experts of load")
    t = measured_loads(loads)
    return loads if np.array_equal(t, np.asarray(loads, dtype=np.float64)) else t.tolist()


# A plan's and a re-plan's searches repeat trades (``count_trading.remembered``).
@remembered()
def plan_job(nodes: Sequence[NodeSpec], experts: int, layers: int, min_replicas: int,
             policy: str = "mro", loads: Sequence[Sequence[float]] | None = None,
             generation: int = 1, reason: str = "Initial",
             max_failures: int = DEFAULT_MAX_FAILURES) -> Plan:
    """A complete plan: replicas per layer from the loads, placed by ``policy``."""
    ordered, replicas, placements = layout(nodes, experts, layers, min_replicas, policy, loads)
    return build_plan(ordered, replicas, placements, experts, min_replicas, policy,
                      generation, reason, max_failures)


def layout(nodes: Sequence[NodeSpec], experts: int, layers: int, min_replicas: int,
           policy: str, loads: Sequence[Sequence[float]] | None):
    """Node order, replicas per layer and placements: a plan before it has node identities."""
    loads = checked_loads(loads, layers, experts)
    ordered, replicas = _positions(nodes, experts, layers, min_replicas, loads)
    slots, gpus = [n.slots for n in ordered], [n.gpus for n in ordered]
    if policy != "mro":
        return ordered, replicas, place(policy, replicas, slots)
    placements = filled(replicas, slots, loads, gpus)
    return ordered, fill_counts(placements, experts).tolist(), placements


def _positions(nodes, experts, layers, min_replicas, loads):
    """Node order and the replicas per layer that the allocation formula gives."""
    ordered = _order(nodes, experts, layers)
    return ordered, allocate_layers(loads, layers, experts, sum(n.slots for n in ordered),
                                    min_replicas)


def _order(nodes, experts, layers) -> list[NodeSpec]:
    """The nodes in position order (``topology.failure_domain_order``), once the sizes are
    checked."""
    if experts < 1:
        raise ValueError(f"experts: must be >= 1, got {experts}")
    if layers < 1:
        raise ValueError(f"layers: must be >= 1, got {layers}")
    check_nodes(list(nodes))
    check_size(len(nodes), max(n.slots for n in nodes), experts, layers)
    return failure_domain_order(list(nodes))


def build_plan(ordered: Sequence[NodeSpec], replicas, placements, experts, min_replicas,
               policy, generation, reason, max_failures,
               devices: Sequence[Sequence[int]] | None = None) -> Plan:
    """``placements``: per layer, per node its slots, or one [layer, slot] array (the
    MRO fill's, kept by the plan: ``LayerPlan.from_slots``). ``devices``: per node, which of
    its GPUs run its ranks in order (default: its usable GPUs in index order)."""
    plan_nodes, rank = [], 0
    for i, n in enumerate(ordered):
        plan_nodes.append(PlanNode(name=n.name, ranks=tuple(range(rank, rank + n.gpus)),
                                   slots_per_rank=n.slots_per_gpu, zone=n.zone,
                                   devices=tuple(devices[i] if devices else n.devices)))
        rank += n.gpus
    if isinstance(placements, np.ndarray):
        sizes = [n.slots for n in ordered]
        layers = LayerPlan.from_slots(replicas, placements, sizes)
    else:
        layers = tuple(LayerPlan(tuple(r), tuple(tuple(s) for s in p))
                       for r, p in zip(replicas, placements))
    return validate(Plan(
        generation=generation,
        experts=experts,
        min_replicas=min_replicas,
        policy=policy,
        reason=reason,
        nodes=tuple(plan_nodes),
        layers=layers,
        recovery=(recovery_table(cube_presence(count_cube(layers)), max_failures)
                  if max_failures else {}),
    ))


def surviving_cores(old: Plan, ordered: Sequence[NodeSpec]
                    ) -> tuple[list[list[int]], int | None]:
    """Per layer and expert: its core in ``old`` (anchors.py) as a mask of positions in
    ``ordered``, or 0 when a node of that core is gone; and the size of those cores where
    ``old`` was spread evenly (its cores all sets of ``anchors.even_cover``, together on
    every node), else None."""
    anchors = anchors_of_presence((old.count_cube > 0).transpose(0, 2, 1),
                                  [layer.replicas for layer in old.layers],
                                  largest_core(len(ordered)))
    position = {n.name: q for q, n in enumerate(ordered)}
    translate = {0: 0}
    for core in {c for a in anchors for c in a.cores} - {0}:
        names = [old.nodes[i].name for i in nodes_of(core)]
        translate[core] = (sum(1 << position[name] for name in names)
                           if all(name in position for name in names) else 0)
    cores = set(translate) - {0}
    size = min((c.bit_count() for c in cores), default=0)
    # Spread over every node: MRO's recovery-best structure may also use only sets of
    # ``even_cover`` (pairs of neighbours), on a few nodes (96 nodes: 8 pairs).
    even = (size and cores <= set(even_cover_masks(len(old.nodes), size))
            and reduce(operator.or_, cores) == (1 << len(old.nodes)) - 1)
    return [[translate[c] for c in a.cores] for a in anchors], size if even else None


def _swapped_back(old: Plan, ordered: Sequence[NodeSpec], placements: np.ndarray,
                  counts: np.ndarray, loads: Sequence[Sequence[float]] | None,
                  sources: set[str], search: bool) -> np.ndarray:
    """``swap_back.swapped_back`` of a re-plan's fill on ``ordered`` (``counts``: its
    replicas per layer and expert, which the swaps keep), then, with ``search``,
    ``fewer_copies.with_fewer_copies``."""
    weights = per_replica(counts, loads if loads is not None else np.ones(counts.shape))
    held = _references(old, ordered, sources) > 0
    shape = ([n.slots for n in ordered], [n.slots_per_gpu for n in ordered],
             largest_core(len(ordered)))
    swapped = swapped_back(placements, held, weights, *shape)
    return with_fewer_copies(swapped, held, weights, *shape) if search else swapped


def _references(old: Plan, ordered: Sequence[NodeSpec], sources: set[str]) -> np.ndarray:
    """[layer, position, expert]: replicas the node now at each position already holds
    (int16, as ``Plan.count_cube``: the fill scans all of it)."""
    index = {n.name: i for i, n in enumerate(old.nodes)}
    rows = np.array([index.get(n.name, -1) if n.name in sources else -1 for n in ordered],
                    dtype=np.int64)
    out = old.count_cube[:, np.maximum(rows, 0)]
    out[:, rows < 0] = 0
    return out


@dataclass(frozen=True)
class Replan:
    plan: Plan
    migration: Migration


@remembered()
def replan(old: Plan, nodes: Sequence[NodeSpec], reason: str, sources: set[str],
           loads: Sequence[Sequence[float]] | None = None,
           max_failures: int = DEFAULT_MAX_FAILURES,
           move_price: float = MOVE_PRICE, copy_search: bool = True) -> Replan:
    """The next generation for ``nodes``, mapped onto them to move as little as possible.

    ``sources`` are the old plan's nodes that can still send expert state. ``move_price``:
    how much busier ranks are worth moving every slot (``balance.cheapest``).
    ``copy_search``: a small re-plan made afresh is searched for a placement that copies
    fewer replicas (``fewer_copies.py``: up to about a second); the simulator, which
    re-plans thousands of times, leaves it out.
    """
    if not (isinstance(move_price, (int, float)) and 0 <= move_price < math.inf):
        raise ValueError(f"move_price: must be a number >= 0, got {move_price!r}")

    def finish(ordered, placements, devices=None) -> Replan:
        if not isinstance(placements, np.ndarray):
            placements = np.array([np.concatenate(p) for p in placements], dtype=np.int64)
        counts = fill_counts(placements, old.experts)
        if devices is None:
            # A fill made afresh: replicas it copies to one node while another node copies
            # what the first held go back where they were (swap_back.py), then each rank of
            # a node is played by the GPU of that node that holds most of what it needs.
            placements = _swapped_back(old, ordered, placements, counts, loads, sources,
                                       copy_search)
            devices = map_devices(old, ordered, placements)
        plan = build_plan(ordered, counts.tolist(), placements,
                          old.experts, old.min_replicas, old.policy, old.generation + 1,
                          reason, max_failures, devices)
        return Replan(plan, plan_transfers(old, plan, sources))

    loads = checked_loads(loads, len(old.layers), old.experts)
    if old.policy != "mro":
        positions, _, placements = layout(nodes, old.experts, len(old.layers),
                                          old.min_replicas, old.policy, loads)
        mapping = map_nodes_optimal(old, list(nodes), positions, placements)
        # Position q keeps its slots and zone; it is now played by nodes[mapping[q]].
        return finish([nodes[i] for i in mapping], placements)
    ordered = _order(nodes, old.experts, len(old.layers))
    # A loss: the survivors keep their slots (carry.py), where that balances the ranks, or
    # where the carried plan balances within BALANCED_ENOUGH of the plan before, either
    # way: the loads are then those the plan before was made for, and a plan for a few
    # nodes fewer balances no better than it (the experts at f take a larger share of the
    # slots left). Made afresh, such re-plans took seconds to end within 0.3% of the
    # carried plan, mostly moving more (1,024 GPUs, 8 per node, 58 layers of zipf 1.5, of
    # zipf 0.8-1.4 or of zipf 1.0-1.6, 4 nodes lost: 5.5-7.2 s at 1.0656-1.0662,
    # 1.0587-1.0600 and 1.0839-1.0842, against carried in 0.04-0.06 s at 1.0663-1.0668,
    # 1.0605-1.0608 and 1.0855-1.0858, moving 5-43% less in eight of nine; a plan before
    # within the target, zipf 1.4: 2.5-2.8 s at 1.0528-1.0536 against 1.0542-1.0551).
    # A carried plan far better balanced than the plan before is one of loads that
    # changed, and one far worse lost what a fresh search may find again: both are made
    # afresh, and the carried plan is kept only if it is no worse.
    least, most = _kept_between(old, loads)
    carried = carry(old, ordered, loads, sources, most)
    if carried is not None:
        kept = finish(ordered, carried.placements, carried.devices)
        if carried.balance <= BALANCE_TARGET or least <= carried.balance <= most:
            return kept
    rebuilt = finish(*_restructured(old, ordered, sources, loads, move_price))
    if carried is not None and _no_worse(kept, rebuilt, loads):
        return kept
    return rebuilt


def _restructured(old: Plan, ordered: Sequence[NodeSpec], sources: set[str],
                  loads: Sequence[Sequence[float]] | None, move_price: float):
    """MRO on the nodes themselves: the cores that survived keep their experts
    (``mro.restructure``), the rest is filled afresh; (nodes in position order, placement).
    """
    replicas = allocate_layers(loads, len(old.layers), old.experts,
                               sum(n.slots for n in ordered), old.min_replicas)
    slots, gpus = [n.slots for n in ordered], [n.gpus for n in ordered]
    references = _references(old, ordered, sources)
    every = masks_of((references > 0).transpose(0, 2, 1).reshape(-1, len(ordered)))
    holders = [every[i:i + old.experts] for i in range(0, len(every), old.experts)]
    previous, spread = surviving_cores(old, ordered)
    options, rescues = restructure(replicas, slots, loads, gpus, previous, holders,
                                   [layer.replicas for layer in old.layers], spread)
    weights = _weights(loads, len(old.layers), old.experts)

    def fill(make, fresh, alone=False):
        anchors = make()
        if not fresh:
            return ordered, place_anchored(anchors, slots, weights, gpus, references,
                                           trade=loads is not None, alone=alone)
        # Built on positions: the nodes that hold its anchors play them.
        on = map_anchors(anchors, ordered, references)
        return on, place_toward_holders(anchors, slots, weights, gpus,
                                        _references(old, on, sources),
                                        trade=loads is not None, alone=alone)

    per_rank = [c // g for c, g in zip(slots, gpus)]

    def balance(made):
        return filled_balance(made[1], weights, gpus, per_rank)

    def moved(on, placements) -> int:
        """Replicas the fill's nodes must receive: (layer, node, expert)s it places that
        the node does not hold (``migration.plan_transfers`` lists one transfer each)."""
        held = _references(old, on, sources) > 0
        position = np.repeat(np.arange(len(on)), slots)
        cells = (np.arange(len(placements))[:, None] * len(on) + position) * old.experts
        placed = np.zeros(held.size, dtype=bool)
        placed[(cells + placements).ravel()] = True
        return int((placed & ~held.ravel()).sum())

    def traded_again(make, fresh, bound):
        # The first fill and the rescues (the repairs that move least, the first search's
        # choice): where one misses its bound (its most fragile layer filled alone) by more
        # than BALANCED_ENOUGH, its trading, shared over the layers, fell short rather than
        # its structure, and every layer trades again with a lone layer's budget (the
        # benchmark's shape on 40 nodes, 320 GPUs, after losing 4: the repair filled to
        # 1.080 moving 16,114 replicas, against a bound of 1.054, and lost to a fresh
        # structure's 1.046 moving 40,152; traded again, 1.053 and 16,154; 256 GPUs, zipf
        # 0.4-1.0 per layer, after losing 4: the repair rescued 1.127 -> 1.110, moving
        # 14,751). Not every fill: re-plans took 30-50% longer. The two are weighed as
        # every fill is (``balance.cheapest``): on 28 nodes, trading again gained 0.4% for
        # 3,676 more replicas moved, 8% of the slots.
        made = fill(make, fresh)
        worst = balance(made)
        if worst <= bound * BALANCED_ENOUGH:
            return made
        again = fill(make, fresh, alone=True)
        return cheapest([(worst, moved(*made) / made[1].size, made),
                         (balance(again), moved(*again) / again[1].size, again)],
                        move_price)[2]

    # The fills are weighed on what they move (``moved``), and a costly one is made only
    # where its bound promises more than BALANCED_ENOUGH, as ``mro.restructure`` ranks
    # them: a later option moves more (after losing one of 128 nodes, zipf 1.5 loads:
    # 18,386 replicas for 1.063 against 696 for 1.064).
    return first_balanced([lambda: traded_again(*options[0])]
                          + [lambda option=option: fill(*option[:2]) for option in options[1:]],
                          weights, gpus, slots, BALANCED_ENOUGH,
                          rescues=[lambda rescue=rescue: traded_again(*rescue)
                                   for rescue in rescues],
                          bounds=[o[2] for o in options + rescues], moved=moved,
                          move_price=move_price)


def _kept_between(old: Plan, loads) -> tuple[float, float]:
    """The busiest rank a carried plan is kept at without a search afresh, besides within
    the target: the plan before's under ``loads``, within ``BALANCED_ENOUGH`` either way.
    The upper bound, or the target where higher, is what ``carry`` trades its layers to."""
    before = busiest_rank(old, _weights(loads, len(old.layers), old.experts))
    return before / BALANCED_ENOUGH, max(BALANCE_TARGET, before * BALANCED_ENOUGH)


def carried_over(old: Plan, nodes: Sequence[NodeSpec], loads,
                 sources: set[str]) -> Carried | None:
    """What ``carry`` answers for ``nodes`` as ``replan`` calls it."""
    return carry(old, _order(nodes, old.experts, len(old.layers)), loads, sources,
                 _kept_between(old, loads)[1])


def _no_worse(kept: Replan, rebuilt: Replan, loads) -> bool:
    """Whether the carried re-plan is at least as good as the rebuilt one on all three
    counts: fatal failure sets up to ``REPLAN_FAILURES`` nodes (as ``mro.restructure``
    compares re-plans), the busiest rank, and replicas moved."""
    loads = _weights(loads, len(kept.plan.layers), kept.plan.experts)
    return (all(a <= b for a, b in zip(_fatal_sets(kept.plan), _fatal_sets(rebuilt.plan)))
            and busiest_rank(kept.plan, loads) <= busiest_rank(rebuilt.plan, loads)
            and kept.migration.experts_migrated <= rebuilt.migration.experts_migrated)


def _fatal_sets(plan: Plan) -> list[int]:
    """How many sets of k nodes lose some expert's every replica, k = 1..REPLAN_FAILURES."""
    return fatal_counts(minimal_masks(cube_presence(plan.count_cube), REPLAN_FAILURES),
                        len(plan.nodes), REPLAN_FAILURES)
