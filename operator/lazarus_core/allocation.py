"""Replica allocation: how many replicas each expert of one layer gets (paper §4.1).

Experts are visited from the least to the most loaded. Each takes its load's share of the
slots still free, but never fewer than ``min_replicas``:

    r_e = max(floor(t_e / Σ_{e'≥e} t_e' · (N·c − Σ_{e'<e} r_e')), f)

and the most loaded expert takes whatever is left, so Σ r_e = N·c exactly even when
floating-point shares would round a slot away.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .balance import nth_in_run


class InfeasibleError(ValueError):
    """The cluster has too few slots to give every expert ``min_replicas`` replicas."""


# A share that lands a hair under an integer (2.9999999999 for 3) must floor to that integer.
_FLOOR_SLACK = 1e-9

# A first pass lists a layer's donor levels under a lower cut (``_cutoff``) where more than
# this many are under its highest receiver level.
MANY_LEVELS = 256


def measured_loads(loads) -> np.ndarray:
    """Expert loads as the solver weighs them, [layer, expert] (a new array): every load
    a finite number >= 0 and every layer's sum finite, or ValueError; a layer with no
    traffic measured yet (every load 0) has its experts equal, and one of loads too small
    or too large for the solver's arithmetic is scaled (below)."""
    finite = ValueError("loads: every expert load must be a finite number >= 0")
    try:
        t = np.array(loads, dtype=np.float64)
    except OverflowError:  # an integer past the largest float
        raise finite from None
    if not (np.isfinite(t).all() and (t >= 0).all()):
        raise finite
    with np.errstate(over="ignore"):
        sums = t.sum(axis=1)
    if not np.isfinite(sums).all():
        raise ValueError(f"loads: layer {int(np.flatnonzero(~np.isfinite(sums))[0])}'s loads "
                         "sum past the largest float; scale every load down alike")
    t[sums <= 0] = 1.0
    # Shares are what the solver weighs, the same at any scale, so a layer whose largest
    # load lies beyond the square roots of the smallest and largest floats is scaled to a
    # largest of 1: a replica's share of a subnormal load rounds to 0 (a layer of [0, 5e-324]
    # ended in a numpy error), and the squares of rank loads that break ties in trading
    # underflow or overflow there. Loads within are kept exactly.
    largest = t.max(axis=1, initial=0.0)  # (0 for a layer of no experts, refused later)
    far = (largest < _SMALLEST_SCALE) | (largest > _LARGEST_SCALE)
    t[far] /= largest[far, None]
    return t


_SMALLEST_SCALE = float(np.sqrt(np.finfo(np.float64).tiny))  # 1.5e-154
_LARGEST_SCALE = float(np.sqrt(np.finfo(np.float64).max))  # 1.3e154


def allocate_replicas(loads: Sequence[float], total_slots: int, min_replicas: int) -> list[int]:
    """Replica count per expert (expert-id order) for one layer."""
    return allocate_many([loads], total_slots, min_replicas)[0]


def allocate_many(loads: Sequence[Sequence[float]], total_slots: int,
                  min_replicas: int) -> list[list[int]]:
    """``allocate_replicas`` for every layer at once: the formula walks the experts in
    order, so the layers go side by side (a re-plan of 58 layers x 256 experts spent 5 ms
    in a Python loop per layer). Same arithmetic, in the same order, as one layer at a
    time."""
    t = measured_loads(loads)
    if t.ndim != 2 or t.shape[1] == 0:
        raise ValueError("experts: need at least one expert")
    num_layers, num_experts = t.shape
    if min_replicas < 1:
        raise ValueError(f"min_replicas: must be >= 1, got {min_replicas}")
    if total_slots < num_experts * min_replicas:
        raise InfeasibleError(
            f"slots: {total_slots} expert slots cannot hold {num_experts} experts x "
            f"{min_replicas} replicas = {num_experts * min_replicas}; add nodes or slots"
            + (f", or lower min_replicas to {total_slots // num_experts}"
               if total_slots >= num_experts else "")
        )

    order = np.argsort(t, axis=1, kind="stable")  # least loaded first, ties by expert id
    ranked = np.take_along_axis(t, order, axis=1)
    # suffix[:, i] = load of ranked[:, i:], summed from the small end (a running sum)
    suffix = np.cumsum(ranked[:, ::-1], axis=1)[:, ::-1]
    # Each expert's fraction of the load still to place, divided out for all at once (the
    # loop below then multiplies: the same arithmetic, in the same order), expert by
    # expert in rows; no fraction where nothing is left to place.
    with np.errstate(divide="ignore", invalid="ignore"):
        fraction = np.where(suffix > 0, ranked / suffix, 0.0).T.copy()
    counts = np.empty((num_experts, num_layers), dtype=np.int64)
    free = np.full(num_layers, total_slots, dtype=np.int64)
    for i in range(num_experts - 1):
        r = np.maximum(np.floor(fraction[i] * free + _FLOOR_SLACK).astype(np.int64),
                       min_replicas)
        # Leave every expert still to come its minimum, whatever rounding did.
        r = np.minimum(r, free - (num_experts - 1 - i) * min_replicas)
        counts[i] = r
        free -= r
    counts[-1] = free
    counts = counts.T
    replicas = np.empty_like(counts)
    np.put_along_axis(replicas, order, counts, axis=1)
    return replicas.tolist()


def even_out(replicas: Sequence[Sequence[int]], loads: Sequence[Sequence[float]],
             keep: int | Sequence[int]) -> list[list[int]]:
    """Every layer's replica counts traded so that no replica carries much more load than
    the mean.

    The formula above floors every share and gives the rounding left over to the most
    loaded expert, so an expert whose share is 2.9 slots gets 2 replicas, each carrying
    1.45 times the mean. One replica at a time moves from the expert whose replicas would
    still carry the least load to the expert whose replicas carry the most, while that
    lowers the most. Donors keep at least ``keep`` replicas, one number or one per layer
    (a placement passes the number of nodes, so no donor's node set shrinks, or the
    layer's fewest where that trades too little: ``mro._evened``); every count stays at
    least what the formula gave or ``keep``, and more load still never gets fewer
    replicas.

    The trades merge two sequences: the levels at which receivers gain, t_e / (r_e + j)
    for j = 0, 1, ..., visited from the highest (ties: more load, then id), and the levels
    donors carry once they have given, t_e / (r_e - 1 - j) for j < r_e - keep, visited
    from the lowest (ties: less load, then id). No expert is on both sides: one that
    received would give back at the level it received at, above any level still to come,
    and one that gave would receive at the level it gave at, below any still to come. So
    the i-th trade happens while the i-th donor level is below the i-th receiver level,
    and as both sequences are monotone the trades are a prefix: one comparison of the
    sorted sequences counts them, for every layer at once. Each expert's first few levels
    on each side suffice unless one of them uses its whole window within the first trades
    + 1; those layers are done again with windows four times as long. (58 layers of 256
    experts: 16 ms as a heap loop per layer, 8 ms so.)
    """
    r = np.asarray(replicas, dtype=np.int64).reshape(len(replicas), -1)
    t = np.asarray(loads, dtype=np.float64).reshape(r.shape)
    floor = np.broadcast_to(np.asarray(keep, dtype=np.int64).reshape(-1, 1), r.shape)
    out = r.copy()
    todo = np.flatnonzero(t.sum(axis=1) > 0)
    gaining, giving, first = 2, 64, True
    while len(todo):
        done, counts = _traded(r[todo], t[todo], floor[todo], gaining, giving, first)
        out[todo[done]] = counts[done]
        todo = todo[~done]
        gaining, giving, first = 4 * gaining, 4 * giving, False
    return out.tolist()


def _traded(r: np.ndarray, t: np.ndarray, keep: np.ndarray, gaining: int, giving: int,
            first: bool) -> tuple[np.ndarray, np.ndarray]:
    """``even_out``'s counts for every layer, with ``gaining`` levels of each
    receiver and ``giving`` of each donor, and which layers those windows decide (on a
    ``first`` pass, donor levels listed only below ``_cutoff``)."""
    num_layers, num_experts = r.shape
    rows = np.arange(num_layers)[:, None]
    ids = np.broadcast_to(np.arange(num_experts), r.shape)
    # Receivers laid out in their tie order, so that a stable sort of the levels visits
    # them in order (an expert's own levels only fall).
    up = np.lexsort((ids, -t))
    r_up, t_up = r[rows, up, None], t[rows, up, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        gain = np.where(r_up > 0, t_up / (r_up + np.arange(gaining)), -np.inf)
    gain = gain.reshape(num_layers, -1)
    gain_order = np.argsort(-gain, axis=1, kind="stable")
    gained = np.take_along_axis(gain, gain_order, axis=1)
    # Donors in their tie order, and of each window only the levels below its layer's
    # highest receiver level: no other can be traded (a trade needs a donor level below a
    # receiver's), and an expert's levels only rise as it gives. Where donors keep the
    # layer's fewest, that is about a thousand of a layer's 16,000 levels (1,024 GPUs, 58
    # layers of 256 experts: 28 ms -> 11 ms).
    can = np.maximum(r - keep, 0)
    down = np.lexsort((ids, t, can == 0))
    r_down, t_down, can_down = r[rows, down], t[rows, down], can[rows, down]
    top = gained[:, :1]
    with np.errstate(divide="ignore", invalid="ignore"):
        # Level j is t / (r - 1 - j), below ``top`` where j < r - 1 - t / top: a bound
        # with a level to spare for rounding, each level checked as computed below.
        reach = np.clip(np.floor(r_down + 1 - t_down / top), 0, can_down).astype(np.int64)
    below = top
    many = np.flatnonzero(np.minimum(reach, giving).sum(axis=1) > MANY_LEVELS) if first else []
    if len(many):
        below = top.copy()
        below[many] = _cutoff(gained[many], r_down[many], t_down[many],
                              np.minimum(can_down[many], giving))
        with np.errstate(divide="ignore", invalid="ignore"):
            reach[many] = np.clip(np.floor(r_down[many] + 1 - t_down[many] / below[many]), 0,
                                  can_down[many])
    width = gained.shape[1]
    cut = reach > giving  # windows that may hide levels below ``below``
    reach = np.minimum(reach, giving)
    layer, donor = np.nonzero(reach)
    times = reach[layer, donor]
    layer, donor = np.repeat(layer, times), np.repeat(donor, times)
    level = nth_in_run(layer * num_experts + donor)
    with np.errstate(divide="ignore", invalid="ignore"):
        value = t_down[layer, donor] / (r_down[layer, donor] - 1 - level)
    keep_level = value < below[layer, 0]
    layer, donor, level, value = (a[keep_level] for a in (layer, donor, level, value))
    # Visited from the lowest; ties: the donor's tie order, then its own levels (the
    # order they are listed in: the sort is stable).
    order = np.lexsort((value, layer))
    layer, donor, level, value = layer[order], donor[order], level[order], value[order]
    starts = np.searchsorted(layer, np.arange(num_layers))
    place = np.arange(len(layer)) - starts[layer]
    reached = place < width
    traded = np.zeros(len(layer), dtype=bool)
    traded[reached] = value[reached] < gained[layer[reached], place[reached]]
    trades = np.bincount(layer, weights=traded, minlength=num_layers).astype(np.int64)
    gain_place = _places(gain_order).reshape(num_layers, num_experts, gaining)
    counts = r.copy()
    counts[rows, up] += (gain_place < trades[:, None, None]).sum(axis=2)
    given = place < trades[layer]
    np.subtract.at(counts, (layer[given], down[layer[given], donor[given]]), 1)
    # A window used up within the first trades + 1 may hide the next level that counts.
    last = cut[layer, donor] & (level == giving - 1) & (place <= trades[layer])
    short = ((gain_place[..., -1] <= trades[:, None]).any(axis=1)
             | (np.bincount(layer[last], minlength=num_layers) > 0))
    return ~short, counts


def _cutoff(gained: np.ndarray, r: np.ndarray, t: np.ndarray, most: np.ndarray
            ) -> np.ndarray:
    """[layer, 1]: a receiver level g_j (``gained[:, j]``, the j-th highest) under which
    the donors (counts ``r``, loads ``t``, at most ``most`` levels each) surely have more
    than j levels, the lowest of a few such; the highest level where none is.

    The donor levels under g_j are all that can trade: with m of them and m > j, the next
    donor level D_m is at or above g_j, and the receiver level it would meet, G_m, is at
    or below it (m > j), so D_m does not trade, nor any after it. Where donors keep a
    layer's fewest (1,024 GPUs, 58 layers of 256 experts): ~750 levels a layer under the
    highest receiver level, ~210 under the cut."""
    at = np.array([j for j in (256, 128, 64, 32, 16, 8) if j < gained.shape[1]], dtype=np.int64)
    if not len(at):
        return gained[:, :1]
    level = gained[:, at]  # [layer, candidate]
    real = level > 0  # not a receiver's padding (-inf)
    # Levels of each donor surely below: j < r - 1 - t / level, one fewer for rounding (a
    # level so small that t / level overflows has none below it).
    with np.errstate(over="ignore"):
        sure = np.ceil(r[:, :, None] - 2
                       - t[:, :, None] / np.where(real, level, np.inf)[:, None, :])
    listed = np.clip(sure, 0, most[:, :, None]).sum(axis=1)
    fits = real & (listed > at)
    pick = np.argmax(fits, axis=1)  # the first that fits: the lowest level
    return np.where(fits.any(axis=1), level[np.arange(len(level)), pick],
                    gained[:, 0])[:, None]


def _places(order: np.ndarray) -> np.ndarray:
    """Row by row, each element's place in ``order`` (the inverse permutation)."""
    places = np.empty_like(order)
    places[np.arange(len(order))[:, None], order] = np.arange(order.shape[1])
    return places


def filling_cores(replicas: Sequence[Sequence[int]], loads: np.ndarray, node_slots: int
                  ) -> list[list[int]]:
    """Every layer's counts with its experts at the floor (the fewest replicas of any layer,
    f) filling the f-node cores they will be anchored on, each such core of ``node_slots``
    experts (a node's slots): as many of the coldest experts as those cores hold, while
    their load stays within their slots' share of the layer's; the other experts get the
    formula's counts evened out, f + 1 at least.

    The cold experts' cores are what keeps the fatal sets few (``mro.py``), and their
    replicas are light, so their nodes' ranks carry little and the others more than the
    mean (1,024 GPUs, per-layer zipf 0.8-1.4, the plan the search traded its way to: in
    its busiest layer, 96 ranks on those nodes at 0.59 times the mean, 928 at 1.04).
    Filled to their share, those ranks carry more and the others less, in no more cores:
    the same fatal sets of f nodes. A layer with no
    expert at the floor, or one without replicas, keeps its counts."""
    r = np.asarray(replicas, dtype=np.int64).reshape(len(replicas), -1)
    t = np.asarray(loads, dtype=np.float64).reshape(r.shape)
    floor = int(r[r > 0].min())
    total = int(r[0].sum())
    num_layers, num_experts = r.shape
    held = -(-(r == floor).sum(axis=1) // node_slots) * node_slots
    order = np.argsort(t, axis=1, kind="stable")  # coldest first, ties by expert id
    ranked = np.take_along_axis(t, order, axis=1)
    within = (np.cumsum(ranked, axis=1)
              <= (t.sum(axis=1) * floor * held / total)[:, None]).sum(axis=1)
    # At least as many as leave the others f + 1 replicas each.
    fewest = max((floor + 1) * num_experts - total, 0)
    # And one expert at least beyond them, to take the slots left (unless there are none).
    most = num_experts - (total > floor * num_experts)
    cold = np.minimum(np.maximum(within, fewest), np.minimum(held, most))
    # (The counts had held >= fewest at the floor: the others have f + 1 or more.)
    changes = (held > 0) & (r > 0).all(axis=1)
    out = r.copy()
    # Layers that keep as many cold experts share the rest's slots: one allocation each.
    for k in np.unique(cold[changes]).tolist():
        layers = np.flatnonzero(changes & (cold == k))
        rows = layers[:, None]
        out[rows, order[layers, :k]] = floor
        if k < num_experts:
            rest = order[layers, k:]
            formula = allocate_many(t[rows, rest], total - floor * k, floor + 1)
            out[rows, rest] = even_out(formula, t[rows, rest], floor + 1)
    return out.tolist()
