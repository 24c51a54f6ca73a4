"""Anchors: the replicas that hold a placement's recovery; every other replica is free.

The model is lost exactly when the failed nodes cover the node set of some (layer, expert),
so only the minimal such node sets, the *cores*, decide recovery. Every expert's node set
contains a core; one replica on each node of that core is the expert's *anchor*. Moving any
other replica anywhere, even onto a node that already holds the expert, leaves a node set
that still contains its core: the fatal failure sets stay the same or shrink, so recovery
does not drop at any failure count. That freedom is what balancing and migration use
(``balance.py``).

Layers are aligned by anchoring every layer on one family of cores: the cores of the most
fragile layer's placement. A layer whose replica counts, sorted, equal that layer's takes
the same anchors expert by expert in popularity order; any other layer anchors each expert,
coldest first, on the smallest core it can cover that still has room on every node, and
only when none has opens a new core on the nodes with the most room left.
"""
from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, combinations

import numpy as np

from .plan import replica_counts
from .recovery import masks_of, minimal_rows

Placement = list[list[int]]

# ``_deal_evenly`` anchors an expert on the set that holds it rather than on the lightest
# while that set's busiest node is within this fraction of a node's mean anchored load.
HOLDER_SLACK = 0.03
# Work bound of ``toward_holders`` (each trade copies at least one replica fewer).
TRADES_PER_SIZE = 256


@dataclass(frozen=True)
class LayerAnchors:
    """One layer: each expert's core (a node bitmask; 0 for an expert with no replica)."""

    replicas: tuple[int, ...]
    cores: tuple[int, ...]


def anchored_replicas(layers: Sequence[LayerAnchors]) -> np.ndarray:
    """One row (layer, node, expert) per anchored replica of every layer, in (layer, expert,
    node) order."""
    experts = len(layers[0].cores) if layers else 1
    every = list(chain.from_iterable(a.cores for a in layers))
    index = {c: i for i, c in enumerate(dict.fromkeys(every))}  # in order of first use
    which = np.fromiter(map(index.__getitem__, every), dtype=np.int64, count=len(every))
    # Each distinct core's nodes, padded with -1 to the widest: one gather for all pairs
    # (a boolean [pair, node] matrix is most of a re-plan's anchors at 1,024 GPUs).
    members = [nodes_of(c) for c in index]
    width = max((len(m) for m in members), default=0)
    table = np.full((len(members), max(width, 1)), -1, dtype=np.int64)
    for row, m in enumerate(members):
        table[row, :len(m)] = m
    nodes = table[which]  # [pair, node slot]
    pair, slot = np.nonzero(nodes >= 0)  # pair = layer * experts + expert
    return np.column_stack((pair // experts, nodes[pair, slot], pair % experts))


def anchors_of(placements: Sequence[Placement], replicas: Sequence[Sequence[int]],
               largest: int | None = None) -> list[LayerAnchors]:
    """Each layer's anchors: every expert on the smallest core its node set contains, the
    cores being the minimal node sets over all the given layers (those of at most
    ``largest`` nodes: an expert whose node set contains none has no core)."""
    num_experts = len(replicas[0])
    return anchors_of_presence([replica_counts(p, num_experts).T > 0 for p in placements],
                               replicas, largest)


def anchors_of_presence(presence: Sequence[np.ndarray], replicas: Sequence[Sequence[int]],
                        largest: int | None = None) -> list[LayerAnchors]:
    """``anchors_of`` from each layer's [expert, node] presence (``Plan`` keeps its counts)."""
    cores, which = smallest_cores(np.concatenate(presence), largest)
    masks = np.array(masks_of(cores) + [0], dtype=object)  # index -1 (no core): mask 0
    which = masks[which].tolist()
    out, start = [], 0
    for present, counts in zip(presence, replicas):
        out.append(LayerAnchors(tuple(counts), tuple(which[start:start + len(present)])))
        start += len(present)
    return out


def smallest_cores(every: np.ndarray, largest: int | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The cores of [pair, node] presence rows, [core, node] smallest first (the minimal
    rows among those of at most ``largest`` nodes), and each row's smallest core as an
    index into them (-1 where its node set contains none)."""
    rows = every if largest is None else every[np.count_nonzero(every, axis=1) <= largest]
    cores = minimal_rows(rows)
    if not len(cores):
        return cores, np.full(len(every), -1)
    # One product for every row (float32: exact for counts of up to 2^24 nodes, and it
    # runs on BLAS, unlike integers); cores are sorted by size: the first one contained is
    # the smallest.
    contained = every.astype(np.float32) @ cores.T.astype(np.float32) == cores.sum(axis=1)
    return cores, np.where(contained.any(axis=1), contained.argmax(axis=1), -1)


def align(layers: Sequence[Sequence[int]], template: LayerAnchors, slots: Sequence[int],
          weights: Sequence[Sequence[float]], template_weights: Sequence[float], largest: int,
          memo: dict | None = None) -> list[LayerAnchors]:
    """Anchors for every layer on ``template``'s cores (see the module docstring).

    ``weights[l][e]`` is the load each replica of e carries: among experts with equal
    replica counts, the heavier goes first and to the lighter core.

    ``memo`` keeps the anchors of the layers that cannot take the template's as they are,
    by their counts, weights and the template's cores, for one cluster (``slots`` and
    ``largest`` the same at every call): a search aligns one variant after another, and
    most layers keep their counts from one to the next (bench_solver's zipf 0.8-1.4
    plan: 1,140 of 1,291 such layers anchored before).
    """
    family = sorted({c for c in template.cores if c}, key=lambda m: (m.bit_count(), m))
    # A template spread evenly (``anchor_evenly``) is followed so by the layers that cannot
    # take its anchors as they are.
    fewest = min((r for r in template.replicas if r), default=0)
    spread = fewest and set(family) == set(even_cover_masks(len(slots), fewest))
    template_rank = _ranked([template.replicas], [template_weights])[0]
    counts = np.asarray(layers, dtype=np.int64).reshape(len(layers), -1)
    order = _ranking(counts, weights)
    # A layer whose counts, in rank order, are the template's takes its cores rank for
    # rank: each expert's rank (the inverse of its layer's order) picks its core, for every
    # layer in one gather (58 layers of 256 experts: 4.8 ms one expert at a time).
    alike = (np.take_along_axis(counts, order, axis=1)
             == [template.replicas[e] for e in template_rank]).all(axis=1)
    by_rank = np.empty(len(template_rank), dtype=object)
    by_rank[:] = [template.cores[t] for t in template_rank]
    cores = iter(by_rank[np.argsort(order[alike], axis=1)].tolist())
    memo = {} if memo is None else memo
    out = []
    for li, (replicas, experts) in enumerate(zip(layers, order.tolist())):
        if alike[li]:
            out.append(LayerAnchors(tuple(replicas), tuple(next(cores))))
            continue
        key = (tuple(replicas), tuple(weights[li]), tuple(family), bool(spread))
        if key not in memo:
            memo[key] = ((spread and anchor_evenly(replicas, weights[li], slots))
                         or anchor_greedily(replicas, weights[li], family, slots, largest,
                                            order=experts))
        out.append(memo[key])
    return out


def _ranked(layers: Sequence[Sequence[int]], weights: Sequence[Sequence[float]]
            ) -> list[list[int]]:
    """Each layer's experts, fewest replicas first, then the heaviest, then by id (one sort
    for every layer)."""
    return _ranking(layers, weights).tolist()


def _ranking(layers: Sequence[Sequence[int]], weights: Sequence[Sequence[float]]
             ) -> np.ndarray:
    """``_ranked`` as a [layer, rank] array."""
    r = np.asarray(layers, dtype=np.int64).reshape(len(layers), -1)
    w = np.asarray(weights, dtype=np.float64).reshape(r.shape)
    return np.lexsort((np.broadcast_to(np.arange(r.shape[1]), r.shape), -w, r), axis=-1)


def anchor_greedily(replicas: Sequence[int], weights: Sequence[float], family: Sequence[int],
                    slots: Sequence[int], largest: int, sharing: int | None = None,
                    order: Sequence[int] | None = None) -> LayerAnchors:
    """Anchors for one layer: each expert, fewest replicas first, on the smallest of
    ``family``'s cores that it can cover and that has room, or on a new core (the nodes with
    the most room left) when none has; then balanced within (``balance_within``).

    No core has more than ``largest`` nodes: on many nodes only small failure sets are
    scored, and an expert anchored on that many nodes is never one of them. No core anchors
    more than ``sharing`` experts, when given: the cold experts then spread over more cores,
    which often costs fatal sets but leaves their nodes room for heavier replicas (``mro.py``
    tries so where the recovery-best structure leaves the ranks out of balance, and takes it
    only if it recovers as well). ``order``: the experts in ``_ranked`` order, where the
    caller ranked every layer at once.
    """
    if order is None:
        order = _ranked([replicas], [weights])[0]
    anchors = _anchor(replicas, weights, order,
                      sorted(family, key=_size_first), slots, largest, sharing=sharing)
    return balance_within(anchors, weights, len(slots))


def even_cover(num_nodes: int, size: int) -> list[list[int]]:
    """Node sets of ``size`` nodes that put every node in equally many of them, as few as
    can: disjoint groups of ``size``, and the nodes left over joined to the last group,
    whose ``size`` + r nodes take the r + ``size`` windows of ``size`` around that ring
    (each of its nodes in ``size`` of them). [] where fewer than ``size`` nodes."""
    groups, left = divmod(num_nodes, size)
    if not groups:
        return []
    plain = groups - 1 if left else groups
    out = [list(range(g * size, (g + 1) * size)) for g in range(plain)]
    ring = size + left if left else 0
    base = plain * size
    out += [[base + (i + j) % ring for j in range(size)] for i in range(ring)]
    return out


def even_cover_masks(num_nodes: int, size: int) -> list[int]:
    """``even_cover``'s sets as node bitmasks."""
    return [sum(1 << i for i in nodes) for nodes in even_cover(num_nodes, size)]


def anchor_evenly(replicas: Sequence[int], weights: Sequence[float], slots: Sequence[int]
                  ) -> LayerAnchors | None:
    """Anchors for one layer that spread every node's anchored load and count alike: each
    expert anchored on one of ``even_cover``'s sets of q nodes (q: the fewest replicas of
    any expert), each set taking its share of the experts (``_deal_evenly``). Its fatal
    sets are those sets, more than the recovery-best structure's where that one packs the
    coldest experts onto a few nodes, but no node is left with only heavy replicas
    (``mro.py`` weighs one against the other). None where the nodes differ in slots or the
    anchors do not fit."""
    live = [r for r in replicas if r]
    if not live:
        return None
    q = min(live)
    sets = even_cover_masks(len(slots), q)
    return _deal_evenly(sets, replicas, weights, slots, q, None)


def repair(layers: Sequence[Sequence[int]], weights: Sequence[Sequence[float]],
           previous: Sequence[Sequence[int]], holders: Sequence[Sequence[int]],
           slots: Sequence[int], largest: int) -> list[LayerAnchors]:
    """Anchors for every layer that keep each expert on its previous core where that core
    survived (``previous[l][e]``, 0 if not) and still fits; the other experts go as in
    ``anchor_greedily``, on the surviving cores first, and a new core prefers the nodes that
    hold the expert already (``holders[l][e]``, a mask). New cores join the family that
    later layers share."""
    family = sorted({c for cores in previous for c in cores if c}, key=_size_first)
    return [_anchor(r, w, order, family, slots, largest, p, h)
            for r, w, order, p, h in zip(layers, weights, _ranked(layers, weights), previous,
                                         holders)]


def repair_evenly(layers: Sequence[Sequence[int]], weights: Sequence[Sequence[float]],
                  previous: Sequence[Sequence[int]], holders: Sequence[Sequence[int]],
                  slots: Sequence[int], size: int) -> list[LayerAnchors] | None:
    """``repair`` of a plan spread evenly on sets of ``size`` nodes (``anchor_evenly``):
    the sets that survived whole stay; the nodes that lost a set partner are covered anew
    (``even_cover``, partners of one set side by side, so most of their experts need one
    copy), joined by a whole set where fewer than ``size`` are left; every expert is dealt
    as ``anchor_evenly`` deals, preferring the set that holds it (``_deal_evenly``). None
    where the slots differ or the anchors do not fit."""
    n = len(slots)
    if n < size:
        return None
    sets = _whole_sets({c for cores in previous for c in cores if c}, size)
    covered = 0
    for c in sets:
        covered |= c
    orphans = [i for i in range(n) if not covered >> i & 1]
    while orphans and len(orphans) < size and sets:
        orphans = nodes_of(sets.pop()) + orphans  # the last plain set (rings are whole)
    ordered = _partners_first(orphans, holders)
    sets += [sum(1 << ordered[i] for i in nodes) for nodes in even_cover(len(ordered), size)]
    out = []
    for replicas, w, held in zip(layers, weights, holders):
        layer = _deal_evenly(sets, replicas, w, slots, size, held)
        if layer is None:
            return None
        out.append(layer)
    return out


def _deal_evenly(sets: Sequence[int], replicas: Sequence[int], weights: Sequence[float],
                 slots: Sequence[int], size: int, held: Sequence[int] | None
                 ) -> LayerAnchors | None:
    """Each expert anchored on one of ``sets`` (node masks of ``size`` nodes that cover
    every node equally often: ``even_cover``'s), heaviest first onto the set whose busiest
    node carries least, or, within ``HOLDER_SLACK`` of that, onto the set whose nodes hold
    most of it (``held[e]``, a mask: a re-plan copies less). Each set takes a whole number
    of experts so that every node anchors its share, as near as whole numbers allow: a
    node left with fewer anchors than the others takes more of the heavy free replicas,
    and its ranks run over. None where the nodes differ in slots or the anchors do not
    fit."""
    n = len(slots)
    live = [e for e, r in enumerate(replicas) if r]
    members = [nodes_of(c) for c in sets]
    coverage = Counter(i for m in members for i in m)
    if len(set(slots)) != 1 or not sets or len(live) * size > slots[0] * n:
        return None
    seats = _seats([coverage[m[0]] for m in members], len(live), size, n)
    used = [0] * len(sets)
    load = [0.0] * n
    top = [0.0] * len(sets)  # each set's busiest node
    # The sets whose busiest node can change when a set takes an expert: those it meets.
    meets = [[k for k, other in enumerate(sets) if other & mask] for mask in sets]
    open_sets = [j for j in range(len(sets)) if seats[j]]
    cores = [0] * len(replicas)
    # Within this much of the lightest set, the one that holds most of the expert.
    slack = HOLDER_SLACK * sum(weights[e] for e in live) * size / n
    for e in sorted(live, key=lambda e: (-weights[e], e)):
        least = min(top[j] for j in open_sets)
        mine = held[e] if held is not None else 0
        j = min(open_sets, key=lambda j: (top[j] > least + slack,
                                           -(sets[j] & mine).bit_count(), top[j],
                                           used[j] / seats[j], j))
        used[j] += 1
        if used[j] == seats[j]:
            open_sets.remove(j)
        cores[e] = sets[j]
        for i in members[j]:
            load[i] += weights[e]
        for k in meets[j]:
            top[k] = max(load[i] for i in members[k])
    if any(count > slots[0] for count in Counter(i for c in cores if c
                                                 for i in nodes_of(c)).values()):
        return None
    return LayerAnchors(tuple(replicas), tuple(cores))


def _seats(coverage: Sequence[int], experts: int, size: int, n: int) -> list[int]:
    """Whole numbers of experts per set, ``experts`` in all, that give every node about its
    share (experts x size / n anchors): a set whose nodes are each in ``coverage[j]`` sets
    (a ring's) takes that fraction of the share, rounded; the plain sets take the rest, as
    evenly as they can (or, with none, the ring's sets)."""
    share = experts * size / n
    seats = [round(share / c) if c > 1 else 0 for c in coverage]
    plain = [j for j, c in enumerate(coverage) if c == 1]
    left = experts - sum(seats)
    if not plain or left < 0:
        plain, left, seats = list(range(len(coverage))), experts, [0] * len(coverage)
    base, extra = divmod(left, len(plain))
    for k, j in enumerate(plain):
        seats[j] = base + (1 if k < extra else 0)
    return seats


def _whole_sets(cores: set[int], size: int) -> list[int]:
    """The cores of ``size`` nodes that are still an even cover's: each set that overlaps
    no other, and each ring (as many sets as nodes, every node in ``size`` of them) that
    is whole; plain sets last."""
    cores = [c for c in cores if c.bit_count() == size]
    rings, plain = [], []
    left = set(cores)
    while left:
        span = left.pop()
        cluster = {span}
        grew = True
        while grew:
            grew = False
            for c in list(left):
                if c & span:
                    cluster.add(c)
                    span |= c
                    left.discard(c)
                    grew = True
        if len(cluster) == 1:
            plain.append(span)
        elif len(cluster) == span.bit_count() and all(
                sum(1 for c in cluster if c >> i & 1) == size for i in nodes_of(span)):
            rings += sorted(cluster)
    return rings + sorted(plain)


def _partners_first(nodes: list[int], holders: Sequence[Sequence[int]]) -> list[int]:
    """``nodes`` ordered so that those that hold the most (layer, expert) pairs in common,
    partners of one set before a loss, sit side by side."""
    if len(nodes) < 3:
        return list(nodes)
    bits = np.array([[m >> i & 1 for i in nodes] for layer in holders for m in layer],
                    dtype=np.float32)
    common = bits.T @ bits
    np.fill_diagonal(common, -1)
    out, left = [], set(range(len(nodes)))
    while left:
        a = min(left)
        left.discard(a)
        out.append(nodes[a])
        if left:
            b = max(left, key=lambda j: (common[a, j], -j))
            left.discard(b)
            out.append(nodes[b])
    return out


def _size_first(mask: int) -> tuple[int, int]:
    return mask.bit_count(), mask


def _anchor(replicas, weights, order: Sequence[int], family: list[int], slots, largest: int,
            previous=None, holders=None, sharing: int | None = None) -> LayerAnchors:
    """The greedy of ``anchor_greedily``, visiting experts in ``order`` (``_ranked``);
    ``family`` (sorted) grows with each new core.

    Experts whose previous core still fits go first, so that the others cannot take the
    room they need on it."""
    n = len(slots)
    room = list(slots)
    full = 0
    cores = [0] * len(replicas)
    nodes: dict[int, list[int]] = {}
    users = Counter()
    load = [0.0] * n

    def members(core: int) -> list[int]:
        if core not in nodes:
            nodes[core] = nodes_of(core)
        return nodes[core]

    def take(e: int, core: int, on: list[int] | None = None) -> None:
        """Anchor e on ``core`` (whose nodes are ``on``, when the caller has them)."""
        nonlocal full
        cores[e] = core
        users[core] += 1
        weight = weights[e]
        for i in on if on is not None else members(core):
            load[i] += weight
            room[i] -= 1
            if not room[i]:
                full |= 1 << i

    if previous is not None:
        cap = min(n, largest)
        kept = [e for e in order
                if previous[e] and previous[e].bit_count() <= min(replicas[e], cap)]
        # Every previous core that fits is kept unless some node runs out of room first;
        # when no node is asked for more than it has, none does, and they are taken at once
        # (most re-plans: far fewer distinct cores than experts).
        by_core = Counter(previous[e] for e in kept)
        demand = [0] * n
        for core, count in by_core.items():
            for i in members(core):
                demand[i] += count
        if all(d <= r for d, r in zip(demand, room)):
            carried = [0.0] * len(by_core)
            index = {core: j for j, core in enumerate(by_core)}
            for e in kept:
                cores[e] = previous[e]
                carried[index[previous[e]]] += weights[e]
            for core, j in index.items():
                for i in members(core):
                    load[i] += carried[j]
            users.update(by_core)
            room = [r - d for r, d in zip(room, demand)]
            full = sum(1 << i for i in range(n) if not room[i])
        else:
            for e in kept:
                if not previous[e] & full:
                    take(e, previous[e])
    # Every expert with replicas still to anchor (on min(replicas, n, largest) nodes each).
    queue = [e for e in order if replicas[e] and not cores[e]] if n and largest else []
    at = 0
    while at < len(queue):
        e = queue[at]
        at += 1
        size = min(replicas[e], n, largest)
        held = holders[e] if holders is not None else 0
        # The smallest core that fits; among those, the one holding most of e already.
        core, smallest, most = None, 0, -1
        for c in family:  # sorted by size
            width = c.bit_count()
            if width > size or (core is not None and width > smallest):
                break
            if (not c & full and (c & held).bit_count() > most
                    and (sharing is None or users[c] < sharing)):
                core, smallest, most = c, width, (c & held).bit_count()
        if size == largest and held and (core is None or core & held != core):
            # Anchored on ``largest`` nodes, e is never fatal at the failure counts scored:
            # any of the nodes that hold it already will do, and nobody else needs them.
            open_held = _lowest_open(held, room, size)
            if len(open_held) == size:
                take(e, sum(1 << i for i in open_held), open_held)
                continue
        if core is None and sharing is not None:
            core = _superset(family, size, full, room, load)
        if core is None:
            open_nodes = sorted((i for i in range(n) if room[i]),
                                key=lambda i: (not held >> i & 1, -room[i], i))
            core = sum(1 << i for i in open_nodes[:size])
        if core not in family:
            family.append(core)
            family.sort(key=_size_first)
        take(e, core)
        if holders is None and sharing is None:
            # The experts after e (as many replicas or more) take this core too until one
            # of its nodes is full: every core before it in the family is full. Taken at
            # once (a plan's 58 layers of 256 experts, a few cores each); ``load`` serves
            # ``_superset`` only, and is left.
            run = queue[at:at + min(room[i] for i in members(core))]
            for other in run:
                cores[other] = core
            users[core] += len(run)
            for i in members(core):
                room[i] -= len(run)
                if not room[i]:
                    full |= 1 << i
            at += len(run)
    return LayerAnchors(tuple(replicas), tuple(cores))


def _lowest_open(mask: int, room: Sequence[int], count: int) -> list[int]:
    """Up to ``count`` nodes of ``mask`` with room, lowest first (without listing every
    node of a mask that holds most of the cluster)."""
    out = []
    while mask and len(out) < count:
        low = mask & -mask
        i = low.bit_length() - 1
        if room[i]:
            out.append(i)
        mask ^= low
    return out


def _superset(family: Sequence[int], size: int, full: int, room: Sequence[int],
              load: Sequence[float]) -> int | None:
    """A new core of ``size`` nodes made of family cores with room, smallest first, so that
    it adds no fatal set of its own and keeps the nodes outside the family for the heavier
    free replicas; completed with the least loaded nodes that have room."""
    core = 0
    for c in family:
        if c & full or c & core == c or c.bit_count() >= size:
            continue
        if (core | c).bit_count() <= size:
            core |= c
    if not core:
        return None
    others = sorted((i for i in range(len(room)) if room[i] and not core >> i & 1),
                    key=lambda i: (load[i], -room[i], i))
    if len(others) < size - core.bit_count():
        return None
    return core | sum(1 << i for i in others[:size - core.bit_count()])


def balance_within(anchors: LayerAnchors, weights: Sequence[float], n: int) -> LayerAnchors:
    """The same cores, each with as many experts as before, but experts of one core size
    dealt heaviest first to the core whose nodes carry the least anchored load.

    Experts on cores of equal size can trade places without changing any node set's size
    or any core's use, so the failure sets stay exactly the same.
    """
    load = [0.0] * n
    cores = list(anchors.cores)
    by_size: dict[int, list[int]] = {}
    for e, c in enumerate(cores):
        if c:
            by_size.setdefault(c.bit_count(), []).append(e)
    sizes = sorted(by_size)
    for size in sizes:
        # Heaviest first, ties by id (a stable sort keeps ids in order, reversed too).
        members = sorted(by_size[size], key=weights.__getitem__, reverse=True)
        seats = Counter(cores[e] for e in members)
        nodes = {c: nodes_of(c) for c in seats}
        # Each core's busiest node, kept up to date: a deal changes only the cores that
        # share a node with the one dealt to.
        top = {c: max(load[i] for i in nodes[c]) for c in seats}
        if not any(a & b for a, b in combinations(seats, 2)):
            _deal_disjoint(members, weights, seats, top, cores)
            if size != sizes[-1]:  # node loads matter only to the sizes still to deal
                for e in members:
                    for i in nodes[cores[e]]:
                        load[i] += weights[e]
            continue
        for e in members:
            core = min((c for c, left in seats.items() if left), key=lambda c: (top[c], c))
            seats[core] -= 1
            cores[e] = core
            for i in nodes[core]:
                load[i] += weights[e]
            for c in top:
                if c & core:
                    top[c] = max(load[i] for i in nodes[c])
    return LayerAnchors(anchors.replicas, tuple(cores))


def _deal_disjoint(members: Sequence[int], weights: Sequence[float], seats: Counter,
                   top: dict[int, float], cores: list[int]) -> None:
    """``balance_within``'s deal where the cores share no node: a deal then raises only
    its own core's busiest node, by the expert's weight (every node of the core takes it),
    so the least loaded core is kept in a heap, ties to the lower mask as before."""
    heap = [(top[c], c, left) for c, left in seats.items()]
    heapq.heapify(heap)
    for e in members:
        load, core, left = heapq.heappop(heap)
        cores[e] = core
        if left > 1:
            heapq.heappush(heap, (load + weights[e], core, left - 1))


def toward_holders(anchors: LayerAnchors, weights: Sequence[float], held: np.ndarray,
                   slots: Sequence[int], target: float) -> LayerAnchors:
    """The same cores, each anchoring as many experts, with experts of one core size traded
    between cores where that puts more anchors on nodes that hold the expert already
    (``held[node, e]``), so a re-plan copies fewer replicas. As in ``balance_within``, the
    failure sets stay exactly the same.

    A trade is taken only while no node's anchored load per slot (``weights[e]`` a
    replica) passes the larger of the busiest now and ``target`` times the layer's mean:
    the fill balances only the free replicas, so the anchors decide most of it. The
    largest gain first, up to ``TRADES_PER_SIZE`` trades per core size.
    """
    n = len(slots)
    w = np.asarray(weights, dtype=np.float64)
    room = np.asarray(slots, dtype=np.float64)
    cores = list(anchors.cores)
    load = np.zeros(n)
    for e, c in enumerate(cores):
        load[nodes_of(c)] += w[e]
    total = float(np.dot(w, anchors.replicas))
    cap = max(float((load / room).max()), target * total / room.sum()) + 1e-12
    for size in sorted({c.bit_count() for c in cores if c}):
        group = np.array([e for e, c in enumerate(cores) if c.bit_count() == size])
        distinct = sorted({cores[e] for e in group})
        if len(distinct) < 2:
            continue
        on = np.zeros((len(distinct), n), dtype=bool)  # [core, node]
        for j, c in enumerate(distinct):
            on[j, nodes_of(c)] = True
        which = np.array([distinct.index(cores[e]) for e in group])
        # missing[a, j]: nodes of core j that lack expert group[a] (each one a copy).
        missing = size - held[:, group].T.astype(np.int64) @ on.T.astype(np.int64)
        fewest = np.where(on, room[None, :], np.inf).min(axis=1)  # slots, per core
        ga = w[group]
        # Row a's expert takes b's core and b's takes a's: a's nodes change by d[a, b], and
        # the busiest node per slot of a's core rises by rise[a, b], of b's by fall[a, b].
        # Those and every trade's gain in copies are kept up to date as trades are made:
        # a trade changes two rows and two columns of each.
        d = ga[None, :] - ga[:, None]
        rise = np.maximum(d, 0) / fewest[which][:, None]
        fall = np.maximum(-d, 0) / fewest[which][None, :]
        gain = np.zeros((len(group), len(group)), dtype=np.int64)
        _trade_gains(gain, missing, which, np.arange(len(group)))
        for _ in range(TRADES_PER_SIZE):
            # A trade gains only if one of its two experts misses a node now: rows are
            # those experts, columns every expert of the size.
            rows = np.flatnonzero(missing[np.arange(len(group)), which])
            if not len(rows):
                break
            # Only trades that gain can be taken (a few percent of the pairs): the caps are
            # checked for those alone, in the same order, so the first of the largest
            # gains that fit is the same trade.
            gaining = np.flatnonzero(gain[rows] > 0)
            if not len(gaining):
                break
            at, ends = np.divmod(gaining, len(group))
            starts = rows[at]
            top = np.where(on, load / room, -np.inf).max(axis=1)[which]
            fits = ((top[starts] + rise[starts, ends] <= cap)
                    & (top[ends] + fall[starts, ends] <= cap))
            taken = np.where(fits, gain[starts, ends], 0)
            best = int(np.argmax(taken))
            if taken[best] <= 0:
                break
            a, b = int(starts[best]), int(ends[best])
            load[on[which[a]]] += d[a, b]
            load[on[which[b]]] -= d[a, b]
            which[a], which[b] = which[b], which[a]
            pair = np.array([a, b])
            rise[pair] = np.maximum(d[pair], 0) / fewest[which[pair]][:, None]
            fall[:, pair] = np.maximum(-d[:, pair], 0) / fewest[which[pair]][None, :]
            _trade_gains(gain, missing, which, pair)
        for a, e in enumerate(group):
            cores[e] = distinct[which[a]]
    return LayerAnchors(anchors.replicas, tuple(cores))


def _trade_gains(gain: np.ndarray, missing: np.ndarray, which: np.ndarray,
                 experts: np.ndarray) -> None:
    """Rows and columns ``experts`` of ``gain[a, b]``: the copies saved if a and b trade
    cores (``which``; ``missing[a, j]``: nodes of core j that lack a), 0 on one core."""
    now = missing[np.arange(len(which)), which]
    rows = (now[experts, None] + now[None, :] - missing[experts][:, which]
            - missing[:, which[experts]].T)
    rows[which[experts, None] == which[None, :]] = 0
    gain[experts] = rows
    gain[:, experts] = rows.T


def nodes_of(mask: int) -> list[int]:
    """Node positions in a bitmask, lowest first."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out
