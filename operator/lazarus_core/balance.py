"""Balanced fill: which rank holds each replica, given the anchors that hold recovery.

Algorithm 1 gives every replica of expert e the same share of its tokens, t_e / r_e, so a
rank's expert work is the sum of that weight over its slots, and the busiest rank sets the
pace of every step. Anchors (``anchors.py``) fix a node for some replicas; every other
replica may go anywhere without lowering recovery. The fill:

1. pins the anchors to their nodes, and on a re-plan also keeps each replica that the node
   playing that position already holds (``reference``), as far as the new replica counts
   and the node's slots allow, so migration only moves what must move;
2. deals each node's pinned replicas over its ranks, heaviest first in snake order;
3. hands the remaining replicas out in rounds, heaviest first, each round giving one
   replica to every rank with a free slot, the heaviest to the least loaded;
4. swaps replicas between busy and light ranks while that helps: anchors stay on their
   node, kept replicas too unless the ranks are still more than ``BALANCE_TARGET`` apart;
5. with ``trade``, lets a layer still more than ``BALANCE_TARGET`` apart trade replica
   counts (``count_trading.py``): the counts it returns may differ from those given. In a
   fresh fill the layer furthest over trades first, with a lone layer's work bound, and
   the other layers take its placement, renamed by load rank, where that keeps their
   anchors and balances them better (``_borrow_best``); only those it does not serve trade,
   on their share of the fill's work, and may lend theirs in turn.

Ranks follow plan.py: slot s of a node belongs to its rank s // slots_per_rank.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .count_trading import MAX_EVALUATIONS, layer_budget, trade_counts

Placement = list[list[int]]

# A busiest rank within 1% of the mean is not worth more swaps.
BALANCED_ENOUGH = 1.01
# On a re-plan, replicas a node already holds move for balance only while the busiest rank
# is more than 5% above the mean: past that, a step costs more than the transfer.
BALANCE_TARGET = 1.05
# A re-plan weighs a fill's busiest rank against the replicas it moves: moving every slot
# costs as much as ranks 10% busier (a tenth of them, 1%). Copying an expert's weights and
# optimizer state takes seconds where a step slower by 1% loses a second in minutes, so a
# transfer is dear (``cheapest``). The default of a job's spec.movePricePercent, which
# says otherwise where experts are larger or the network slower (job_spec.py).
MOVE_PRICE = 0.1
# Work bounds of the swap rounds (they stop sooner once nothing gains).
MAX_ROUNDS = 64
PATIENCE = 4
# Fills tried where the first option's layers do not all balance (``first_balanced``).
FILLS_TRIED = 3
# A fresh plan tries as many more as fit in this many slots over all layers filled, up to
# MOST_FILLS: where layers differ in shape the most fragile layer's balance ranks the
# options poorly (256 GPUs, zipf 0.7-1.3 per layer: the best of the first three options
# filled every layer to 1.42, the best of ten to 1.23), and the fills of small plans are
# cheap. A re-plan keeps to FILLS_TRIED: it waits on them.
FILL_WORK = 600_000
MOST_FILLS = 12
# Work a fresh plan's layers still over BALANCE_TARGET after the fill share to trade on
# (``traded_on``): twice a fill's.
TRADE_ON_EVALUATIONS = 16_000_000
# Rounds of dealing every node's replicas again and swapping, where a layer is still over
# BALANCE_TARGET after the swaps (``_redeal``).
REDEALS = 3
# Only the busiest ranks matter (the busiest sets the step time): pair this many at most.
MAX_PAIRS = 64
STALLED_ROUNDS = 8
# Rows (layers at work) from which a swap round orders only each row's two ends (``_ends``).
PARTIAL_ROWS = 8


def fill_layers(replicas: Sequence[Sequence[int]], anchored: np.ndarray,
                weights: Sequence[Sequence[float]], ranks_per_node: Sequence[int],
                slots_per_rank: Sequence[int],
                references: Sequence[np.ndarray] | None = None,
                trade: bool = False, alone: bool = False) -> np.ndarray:
    """Every layer's placement, [layer, slot]: the expert id in each slot, node by node in
    position order, rank by rank within a node (``plan.split_slots`` makes lists of it).

    ``anchored`` has one row (layer, node, expert) per anchored replica, and no
    (layer, node, expert) twice; ``references[l][node, e]`` are the replicas of e that the
    node at that position holds already. With ``trade``, layers still out of balance trade
    replica counts, sharing ``count_trading.FILL_EVALUATIONS`` (with ``alone``, each with
    a lone layer's budget, as the most fragile layer was traded to rank the options). The
    layers are independent; doing them in one batch saves the per-call cost of the array
    operations.
    """
    r = np.asarray(replicas, dtype=np.int64)  # [layer, expert]
    w = np.asarray(weights, dtype=np.float64)
    g = np.asarray(ranks_per_node, dtype=np.int64)
    s = np.asarray(slots_per_rank, dtype=np.int64)
    num_layers, num_experts = r.shape
    n = len(g)
    capacity = g * s
    assert (r.sum(axis=1) == capacity.sum()).all(), "replicas must fill every slot"

    # 1. Anchors, and on a re-plan what each node keeps.
    layer_of, nodes, experts = (np.asarray(anchored, dtype=np.int64).reshape(-1, 3).T
                                .astype(np.int64))
    is_anchor = np.ones(len(layer_of), dtype=bool)
    pinned_count = np.bincount(layer_of * num_experts + experts,
                               minlength=num_layers * num_experts).reshape(num_layers, -1)
    if references is not None:
        kl, kn, ke, counts = _kept(references, layer_of, nodes, experts, r, capacity)
        layer_of = np.concatenate((layer_of, np.repeat(kl, counts)))
        nodes = np.concatenate((nodes, np.repeat(kn, counts)))
        experts = np.concatenate((experts, np.repeat(ke, counts)))
        is_anchor = np.concatenate((is_anchor, np.zeros(int(counts.sum()), dtype=bool)))
        pinned_count += np.bincount(kl * num_experts + ke, weights=counts,
                                    minlength=num_layers * num_experts).astype(
                                        np.int64).reshape(num_layers, -1)

    # 2. Pinned replicas onto their node's ranks, heaviest first, in snake order.
    # One integer key per replica (layer, node, heaviest first, expert id): a single stable
    # sort, several times faster than sorting by four keys.
    # by_weight[l]: layer l's experts, heaviest first, then by id; heaviest: its inverse.
    by_weight = np.lexsort((np.broadcast_to(np.arange(num_experts), r.shape), -w))
    heaviest = np.empty_like(r)
    heaviest[np.arange(num_layers)[:, None], by_weight] = np.arange(num_experts)
    group = layer_of * n + nodes
    by_node = stable_order(group * num_experts + heaviest[layer_of, experts])
    layer_of, nodes, experts, group = (layer_of[by_node], nodes[by_node], experts[by_node],
                                       group[by_node])
    anchor = is_anchor[by_node]
    k = nth_in_run(group)
    gi = g[nodes]
    turn, pos = k // gi, k % gi
    rank_base = np.concatenate(([0], np.cumsum(g)[:-1]))
    num_ranks = int(g.sum())
    ranks = layer_of * num_ranks + rank_base[nodes] + np.where(turn % 2 == 0, pos, gi - 1 - pos)

    rank_slots = np.tile(np.repeat(s, g), num_layers)
    load = np.bincount(ranks, weights=w[layer_of, experts], minlength=num_layers * num_ranks)
    room = rank_slots - np.bincount(ranks, minlength=num_layers * num_ranks)

    # 3. The rest in rounds: heaviest replicas to the least loaded ranks with room.
    # In (layer, heaviest first, expert id) order: each expert's free replicas in turn, the
    # experts in ``by_weight`` order (not a sort of the replicas: 160,000 in a plan at
    # 1,024 GPUs).
    free = r - pinned_count
    in_turn = np.take_along_axis(free, by_weight, axis=1).ravel()
    rest_layer = np.repeat(np.repeat(np.arange(num_layers), num_experts), in_turn)
    rest = np.repeat(by_weight.ravel(), in_turn)
    rest_start = np.searchsorted(rest_layer, np.arange(num_layers))
    left = free.sum(axis=1)
    rest_ranks = np.empty(len(rest), dtype=np.int64)
    while left.any():
        open_ranks = np.flatnonzero(room)
        open_layer = open_ranks // num_ranks
        open_ranks = open_ranks[np.lexsort((load[open_ranks] / rank_slots[open_ranks],
                                            open_layer))]
        open_layer = open_ranks // num_ranks
        nth = nth_in_run(open_layer)
        take = nth < left[open_layer]
        to, at_layer, nth = open_ranks[take], open_layer[take], nth[take]
        item = rest_start[at_layer] + (free.sum(axis=1) - left)[at_layer] + nth
        rest_ranks[item] = to
        load[to] += w[at_layer, rest[item]]
        room[to] -= 1
        left -= np.bincount(at_layer, minlength=num_layers)

    all_layer = np.concatenate((layer_of, rest_layer))
    all_experts = np.concatenate((experts, rest))
    all_ranks = np.concatenate((ranks, rest_ranks))
    rank_node = np.tile(np.repeat(np.arange(n), g), num_layers)
    loose = np.full(len(rest), -1)
    homes = [(np.concatenate((nodes, loose)), BALANCED_ENOUGH)]
    if references is not None:
        # Still out of balance: kept replicas may move after all, each one a transfer.
        homes.append((np.concatenate((np.where(anchor, nodes, -1), loose)), BALANCE_TARGET))
    weight = w[all_layer, all_experts]
    slot_of = _slot_table(all_ranks, len(load))
    for home, enough in homes:
        _exchange(all_ranks, slot_of, weight, home, rank_node, load, rank_slots, num_ranks,
                  enough)
    for _ in range(REDEALS):
        if not _redeal(all_ranks, weight, g, s, load, num_ranks):
            break
        slot_of = _slot_table(all_ranks, len(load))
        _exchange(all_ranks, slot_of, weight, homes[-1][0], rank_node, load, rank_slots,
                  num_ranks, homes[-1][1])
    order = stable_order(all_ranks)
    placed = all_experts[order].reshape(num_layers, -1)
    if not trade:
        return placed
    # 5. Layers still out of balance trade replica counts (count_trading.py).
    per_slot = (load / rank_slots).reshape(num_layers, num_ranks)
    mean = load.reshape(num_layers, num_ranks).sum(axis=1) / rank_slots[:num_ranks].sum()
    over = np.flatnonzero(per_slot.max(axis=1) > BALANCE_TARGET * mean)
    if len(over):
        rank_of_slot = np.repeat(np.arange(num_ranks), rank_slots[:num_ranks])
        # Anchors and, on a re-plan, kept replicas stay what they are: a kept replica
        # traded away is one more transfer.
        final_home = homes[0][0][order].reshape(num_layers, -1)
        t = w * r

        def traded(li: int, row: np.ndarray, budget: int) -> np.ndarray:
            return _redealt(trade_counts(row, rank_of_slot, rank_node[:num_ranks],
                                         final_home[li], t[li], rank_slots[:num_ranks],
                                         int(r[li].min()), BALANCED_ENOUGH, budget),
                            rank_of_slot, t[li], g, s)

        anchors = np.asarray(anchored, dtype=np.int64).reshape(-1, 3)
        own = placed.copy()  # the fill's own placements: ``final_home`` is theirs
        rest = over
        if references is None:
            # The layer furthest over trades first, as a lone layer would; those that
            # take its placement (``_borrow_best``) and balance as well need not trade.
            lead = int(over[np.argmax(layer_balance(placed[over], t[over], g, s))])
            placed[lead] = traded(lead, own[lead], MAX_EVALUATIONS)
            _borrow_best(placed, anchors, t, g, s)
            balance = layer_balance(placed[over], t[over], g, s)
            rest = over[(over != lead) & (balance > BALANCE_TARGET)
                        & (balance > balance[over == lead] + 1e-12)]
        budget = MAX_EVALUATIONS if alone else layer_budget(len(rest))
        for li in rest:
            mine = traded(li, own[li], budget)
            if references is None:  # it may have borrowed a better placement than this
                balance = layer_balance(np.stack((mine, placed[li])), t[[li, li]], g, s)
                if balance[0] >= balance[1]:
                    continue
            placed[li] = mine
        if references is None and len(rest):
            _borrow_best(placed, anchors, t, g, s)
    return placed


def traded_on(placed: np.ndarray, anchored: np.ndarray, loads: Sequence[Sequence[float]],
              ranks_per_node: Sequence[int], slots_per_rank: Sequence[int],
              largest: int) -> np.ndarray:
    """A fresh plan's fill (``placed``, [layer, slot]; loads are t_e) with every layer
    still over ``BALANCE_TARGET`` trading counts on from where the fill left it, each on
    ``TRADE_ON_EVALUATIONS`` shared by those layers: every replica on a node where its
    expert is anchored (``anchored``: (layer, node, expert) rows) stays that expert there,
    and no expert goes below its layer's fewest replicas. An expert's other replicas may go
    only where its anchors span ``largest`` nodes (never fatal at the failure counts
    scored) or are already all the nodes of some expert of the plan: its nodes then still
    hold a fatal set of the fill, so no failure set becomes fatal. A layer takes its trade
    where that balances it better.

    The fill shares ``FILL_EVALUATIONS`` over its layers, and the search weighs options on
    their most fragile layer, so a plan's busiest layer can end just over the target:
    bench_solver's zipf 0.8-1.4 case, layer 44 at 1.0504 (8 million rank loads more leave
    it at 1.0501, 16 million bring it to 1.0496 in 0.15 s; stop 51)."""
    t = np.asarray(loads, dtype=np.float64)
    g = np.asarray(ranks_per_node, dtype=np.int64)
    s = np.asarray(slots_per_rank, dtype=np.int64)
    balance = layer_balance(placed, t, g, s)
    over = np.flatnonzero(balance > BALANCE_TARGET)
    if not len(over):
        return placed
    num_layers, num_experts = t.shape
    n = len(g)
    node_of_slot = np.repeat(np.arange(n), g * s)
    rank_of_slot = np.repeat(np.arange(int(g.sum())), np.repeat(s, g))
    rank_node, rank_slots = np.repeat(np.arange(n), g), np.repeat(s, g)
    rows = np.asarray(anchored, dtype=np.int64).reshape(-1, 3)
    on_anchors = np.zeros((num_layers, num_experts, n), dtype=bool)
    on_anchors[rows[:, 0], rows[:, 2], rows[:, 1]] = True
    present = np.zeros_like(on_anchors)
    present[np.arange(num_layers)[:, None], placed, node_of_slot] = True
    sets = {row.tobytes() for row in np.packbits(present, axis=2).reshape(-1, (n + 7) // 8)}
    pack = np.packbits(on_anchors, axis=2).reshape(-1, (n + 7) // 8)
    free = ((on_anchors.sum(axis=2) >= largest)
            | np.array([row.tobytes() in sets for row in pack]).reshape(num_layers, -1))
    out = placed.copy()
    budget = TRADE_ON_EVALUATIONS // len(over)
    for li in over.tolist():
        x = placed[li]
        pinned = on_anchors[li, x, node_of_slot] | ~free[li, x]
        home = np.where(pinned, node_of_slot, -1)
        fewest = int(np.bincount(x, minlength=num_experts).min())
        mine = _redealt(trade_counts(x, rank_of_slot, rank_node, home, t[li], rank_slots,
                                     fewest, BALANCED_ENOUGH, budget),
                        rank_of_slot, t[li], g, s)
        if layer_balance(mine[None], t[[li]], g, s)[0] < balance[li]:
            out[li] = mine
    return out


def _borrow_best(placed: np.ndarray, anchored: np.ndarray, loads: np.ndarray,
                 ranks_per_node: np.ndarray, slots_per_rank: np.ndarray) -> None:
    """Layers still over ``BALANCE_TARGET`` after trading take the best balanced layer's
    placement, its experts renamed by load rank (its heaviest becomes theirs), where that
    keeps every anchor of theirs on its node and no expert below their fewest replicas,
    and balances them better (``placed`` in place; loads are t_e).

    Aligned layers with the same sorted counts take the same anchors in load order, so
    where layers carry the same loads in another order, all of them then balance as the
    best one does, for the work of trading one (512 GPUs, E = 256, 58 layers: each trading
    on its share of the fill's work ended at 1.051-1.053, the most fragile one alone at
    1.0496). Layers whose loads differ in shape keep their own where it is better.
    """
    num_layers, num_experts = loads.shape
    if num_layers < 2:
        return
    g = np.asarray(ranks_per_node, dtype=np.int64)
    per_rank = np.asarray(slots_per_rank, dtype=np.int64)
    balance = layer_balance(placed, loads, g, per_rank)
    donor = int(np.argmin(balance))
    over = np.flatnonzero((balance > BALANCE_TARGET) & (balance > balance[donor] + 1e-12))
    if not len(over):
        return
    # rank[l, e]: e's place in layer l by load, heaviest first (ties by id); heaviest[l, j]:
    # layer l's expert at place j.
    heaviest = np.lexsort((np.broadcast_to(np.arange(num_experts), loads.shape), -loads))
    rank = np.empty_like(heaviest)
    rank[np.arange(num_layers)[:, None], heaviest] = np.arange(num_experts)
    taken = heaviest[over][:, rank[donor][placed[donor]]]  # [over layer, slot]
    fewest = fill_counts(placed, num_experts).min(axis=1)
    # Anchors held: every anchored (layer, node, expert) of the layers over is in ``taken``.
    n = len(g)
    node_of = np.repeat(np.arange(n), g * per_rank)
    at = np.full(num_layers, -1)
    at[over] = np.arange(len(over))
    held = np.zeros(len(over) * n * num_experts, dtype=bool)
    held[((np.arange(len(over))[:, None] * n + node_of) * num_experts + taken).ravel()] = True
    rows = anchored[at[anchored[:, 0]] >= 0]
    missing = ~held[(at[rows[:, 0]] * n + rows[:, 1]) * num_experts + rows[:, 2]]
    keeps = np.bincount(at[rows[:, 0]][missing], minlength=len(over)) == 0
    better = (keeps & (fewest[donor] >= fewest[over])
              & (layer_balance(taken, loads[over], g, per_rank) < balance[over] - 1e-12))
    placed[over[better]] = taken[better]


def _redealt(experts: np.ndarray, rank_of_slot: np.ndarray, loads: np.ndarray,
             ranks_per_node: np.ndarray, slots_per_rank: np.ndarray) -> np.ndarray:
    """One layer's slots (``experts[s]`` on rank ``rank_of_slot[s]``) with each node's
    replicas dealt over its ranks again where that helps (``_redeal``); loads are t_e."""
    counts = np.bincount(experts, minlength=len(loads))
    weights = loads[experts] / counts[experts]
    ranks = rank_of_slot.copy()
    load = np.bincount(ranks, weights=weights, minlength=int(ranks_per_node.sum()))
    if not _redeal(ranks, weights, ranks_per_node, slots_per_rank, load, len(load)):
        return experts
    return experts[np.argsort(ranks, kind="stable")]


def _slot_table(ranks: np.ndarray, num_all_ranks: int) -> np.ndarray:
    """[rank, slot]: the replica (index into ``ranks``) in each slot of each rank, -1 for
    none."""
    order = stable_order(ranks)
    counts = np.bincount(ranks, minlength=num_all_ranks)
    width = int(counts.max()) if len(counts) else 0
    if (counts == width).all():  # every rank full and alike: the sorted order, cut in rows
        return order.reshape(num_all_ranks, width)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    slot_of = np.full((num_all_ranks, width), -1, dtype=np.int64)
    slot_of[ranks[order], np.arange(len(ranks)) - starts[ranks[order]]] = order
    return slot_of


def _exchange(ranks: np.ndarray, slot_of: np.ndarray, weights: np.ndarray, home: np.ndarray,
              rank_node: np.ndarray, load: np.ndarray, rank_slots: np.ndarray,
              num_ranks: int, enough: float) -> None:
    """In every layer, pair its busiest ranks with lighter ones, and in every pair at once
    make the one swap of two replicas that lowers the pair's larger load the most
    (``ranks`` and ``slot_of``, its ``_slot_table``, in place; ranks are numbered layer by
    layer, ``num_ranks`` to a layer).

    Round t pairs a layer's i-th busiest rank with its (i + t)-th lightest, so a busy rank
    meets other partners. A layer stops after ``PATIENCE`` rounds in a row gain nothing, or
    ``STALLED_ROUNDS`` leave its busiest rank as it was, or once its busy ranks are within
    ``enough`` times its mean. A replica pinned to a node (``home`` >= 0) only trades places
    with replicas on that node; the others trade with any free replica.
    """
    num_layers = len(load) // num_ranks
    width = slot_of.shape[1]
    if (slot_of < 0).any():  # ranks of different sizes: a sentinel for the empty slots
        padded_w, padded_home = np.append(weights, np.nan), np.append(home, -2)
    else:
        padded_w, padded_home = weights, home
    layer_slots = rank_slots.reshape(num_layers, num_ranks).sum(axis=1)
    half = num_ranks // 2
    pairs = min(half, MAX_PAIRS)
    if not pairs:
        return
    idle = np.zeros(num_layers, dtype=np.int64)
    stalled = np.zeros(num_layers, dtype=np.int64)
    busiest = np.full(num_layers, np.inf)
    base = (np.arange(num_layers) * num_ranks)[:, None]
    for t in range(MAX_ROUNDS):
        per_slot = (load / rank_slots).reshape(num_layers, num_ranks)
        top = per_slot.max(axis=1)
        stalled = np.where(top >= busiest - 1e-12, stalled + 1, 0)
        busiest = np.minimum(busiest, top)
        mean = load.reshape(num_layers, num_ranks).sum(axis=1) / layer_slots
        active = (idle < min(half, PATIENCE)) & (stalled < STALLED_ROUNDS) & (
            top > enough * mean)
        if not active.any():
            return
        # Only the layers still at work are sorted (most stop within a few rounds).
        at_work = np.flatnonzero(active)
        heavy, light = _ends(per_slot[at_work], pairs, (np.arange(pairs) + t) % half)
        heavy, light = heavy + base[at_work], light + base[at_work]
        busy = per_slot.ravel()[heavy] > (enough * mean[at_work])[:, None]
        heavy, light = heavy[busy], light[busy]
        xh, xl = slot_of[heavy], slot_of[light]
        # Ranks on two nodes can only swap two free replicas: pairs without are left out
        # before the [pair, slot, slot] arrays are made (on a re-plan most are pinned).
        can = (rank_node[heavy] == rank_node[light]) | (
            (padded_home[xh] == -1).any(axis=1) & (padded_home[xl] == -1).any(axis=1))
        heavy, light, xh, xl = heavy[can], light[can], xh[can], xl[can]
        d = padded_w[xh][:, :, None] - padded_w[xl][:, None, :]
        hh, hl = padded_home[xh][:, :, None], padded_home[xl][:, None, :]
        node = rank_node[heavy][:, None, None]
        same = node == rank_node[light][:, None, None]
        ok = (d > 0) & (((hh == -1) & (hl == -1))
                        | (same & ((hh == -1) | (hh == node)) & ((hl == -1) | (hl == node))))
        after = np.maximum((load[heavy][:, None, None] - d) / rank_slots[heavy][:, None, None],
                           (load[light][:, None, None] + d) / rank_slots[light][:, None, None])
        after = np.where(ok, after, np.inf).reshape(len(heavy), width * width)
        pick = np.argmin(after, axis=1)
        gain = after[np.arange(len(heavy)), pick] < load[heavy] / rank_slots[heavy] - 1e-12
        gained = np.bincount(heavy[gain] // num_ranks, minlength=num_layers) > 0
        idle = np.where(active & ~gained, idle + 1, np.where(gained, 0, idle))
        heavy, light, pick = heavy[gain], light[gain], pick[gain]
        a, b = pick // width, pick % width
        x, y = slot_of[heavy, a], slot_of[light, b]
        delta = weights[x] - weights[y]
        load[heavy] -= delta
        load[light] += delta
        ranks[x], ranks[y] = light, heavy
        slot_of[heavy, a], slot_of[light, b] = y, x


def _ends(x: np.ndarray, top: int, places: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row by row, where a stable argsort of ``x`` would put them: the ``top`` largest,
    largest first (of equals, the later index first), and the elements at ``places``
    (ascending order). Rows of a thousand ranks need only their two ends ordered: what
    passes each end's cut (np.partition), ties included, is sorted, and the rest not."""
    rows, width = x.shape
    low = int(places.max()) + 1
    if rows < PARTIAL_ROWS or low + top >= width:
        order = np.argsort(x, axis=1, kind="stable")
        return order[:, ::-1][:, :top], order[:, places]
    cuts = np.partition(x, (low - 1, width - top), axis=1)
    row, col = np.nonzero(x <= cuts[:, low - 1:low])  # row by row, columns in order
    order = np.lexsort((x[row, col], row))
    keep = nth_in_run(row[order]) < low
    lightest = col[order][keep].reshape(rows, low)
    row, col = np.nonzero(x >= cuts[:, width - top:width - top + 1])
    order = np.lexsort((-col, -x[row, col], row))
    keep = nth_in_run(row[order]) < top
    return col[order][keep].reshape(rows, top), lightest[:, places]


def _redeal(ranks: np.ndarray, weights: np.ndarray, ranks_per_node: np.ndarray,
            slots_per_rank: np.ndarray, load: np.ndarray, num_ranks: int) -> bool:
    """In every layer whose busiest rank is still over ``BALANCE_TARGET``, deal each node's
    replicas over its ranks again, heaviest first to the least loaded rank with room, where
    that leaves the node's busiest rank lighter (``ranks`` and ``load`` in place; whether
    any replica moved). Swaps of two replicas cannot reach some spreads: with 11 heavy
    replicas on a node of 8 ranks of 4 slots, the three ranks that take two heavy ones
    need the node's lightest pairs.

    A node's ranks hold only what is pinned to that node or free, so any order of its
    replicas over its ranks keeps anchors and kept replicas home."""
    n = len(ranks_per_node)
    num_layers = len(load) // num_ranks
    slots_of_rank = np.repeat(slots_per_rank, ranks_per_node)
    per_slot = load.reshape(num_layers, num_ranks) / slots_of_rank
    mean = load.reshape(num_layers, num_ranks).sum(axis=1) / slots_of_rank.sum()
    over = per_slot.max(axis=1) > BALANCE_TARGET * mean
    if not over.any():
        return False
    at = np.flatnonzero(over[ranks // num_ranks])
    rank_base = np.concatenate(([0], np.cumsum(ranks_per_node)[:-1]))
    rank_node = np.repeat(np.arange(n), ranks_per_node)
    node = rank_node[ranks[at] % num_ranks]
    group = (ranks[at] // num_ranks) * n + node  # (layer, node)
    order = np.lexsort((-weights[at], group))
    group, node, at = group[order], node[order], at[order]
    nth = nth_in_run(group)
    width = int(ranks_per_node.max())
    capacity = np.where(np.arange(width)[None, :] < ranks_per_node[:, None],
                        slots_per_rank[:, None], 0)  # [node, rank within]
    groups, first = np.unique(group, return_index=True)
    slot = np.searchsorted(groups, group)  # each replica's row among the groups
    dealt = np.zeros((len(groups), width))
    room = capacity[node[first]].copy()
    # [group, p]: each group's p-th heaviest replica, dealt in turn over all groups at
    # once (the rows of the groups that have one: every group, where nodes fill alike).
    turns = int(nth.max()) + 1
    weight, has = np.zeros((len(groups), turns)), np.zeros((len(groups), turns), dtype=bool)
    weight[slot, nth], has[slot, nth] = weights[at], True
    picks = np.empty((len(groups), turns), dtype=np.int64)
    every = np.arange(len(groups))
    for p in range(turns):
        pick = np.argmin(np.where(room > 0, dealt, np.inf), axis=1)
        rows = every if has[:, p].all() else np.flatnonzero(has[:, p])
        dealt[rows, pick[rows]] += weight[rows, p]
        room[rows, pick[rows]] -= 1
        picks[:, p] = pick
    to = picks[slot, nth]
    # Per group: its busiest rank per slot as the swaps left it and as dealt.
    layer_of_group, node_of_group = np.divmod(groups, n)
    start = layer_of_group * num_ranks + rank_base[node_of_group]
    within = np.arange(width)[None, :]
    real = within < ranks_per_node[node_of_group][:, None]
    now_load = np.where(real, load[np.where(real, start[:, None] + within, 0)], -np.inf)
    per = np.maximum(capacity[node_of_group], 1)
    before = (now_load / per).max(axis=1)
    after = np.where(real, dealt / per, -np.inf).max(axis=1)
    better = after < before - 1e-12
    if not better.any():
        return False
    take = better[slot]
    moved = at[take]
    ranks[moved] = start[slot[take]] + to[take]
    load[:] = np.bincount(ranks, weights=weights, minlength=len(load))
    return True


def _kept(references: Sequence[np.ndarray], layer_of: np.ndarray, nodes: np.ndarray,
          experts: np.ndarray, replicas: np.ndarray, capacity: np.ndarray):
    """Replicas each node keeps from ``references`` (per layer, [node, expert]) besides its
    anchors (one row per anchor in ``layer_of``, ``nodes``, ``experts``): no more per
    expert than the new count leaves after the anchors, no more per node than its slots
    left after its anchors, nodes in order. As (layer, node, expert, count) arrays; only
    what a node holds is looked at, not every (node, expert) pair."""
    num_layers, num_experts = replicas.shape
    n = len(capacity)
    stacked = np.asarray(references)
    # In (layer, node, expert) order; a flat index of a boolean mask, split by hand, is
    # several times faster than np.nonzero of the counts.
    key = np.flatnonzero(stacked != 0)
    kl, at_node = np.divmod(key, n * num_experts)
    kn, ke = np.divmod(at_node, num_experts)
    count = stacked.ravel()[key]
    # Take out the anchor (at most one per layer, node, expert).
    anchored = np.zeros(num_layers * n * num_experts, dtype=np.int8)
    anchored[(layer_of * n + nodes) * num_experts + experts] = 1
    spare = count - anchored[key]
    # Per expert: keep in node order while the count left after the anchors allows.
    free = (replicas.ravel() - np.bincount(layer_of * num_experts + experts,
                                           minlength=num_layers * num_experts))
    # Only groups that hold more than their limit need the turns (most keep all they
    # hold), so only their elements are sorted and walked.
    pair = kl * num_experts + ke
    kept = spare.astype(np.int64)
    over = np.bincount(pair, weights=kept, minlength=num_layers * num_experts) > free
    at = np.flatnonzero(over[pair])
    at = at[np.argsort(pair[at] * n + kn[at], kind="stable")]
    kept[at] = _take_in_turn(kept[at], pair[at], free[pair[at]])
    # Per node (nonzero gives them in layer, node, expert order): what its slots allow.
    room = (np.tile(capacity, num_layers) - np.bincount(layer_of * n + nodes,
                                                        minlength=num_layers * n))
    node = kl * n + kn
    at = np.flatnonzero((np.bincount(node, weights=kept, minlength=num_layers * n) > room)[node])
    kept[at] = _take_in_turn(kept[at], node[at], room[node[at]])
    keep = kept > 0
    return kl[keep], kn[keep], ke[keep], kept[keep]


def stable_order(keys: np.ndarray) -> np.ndarray:
    """``np.argsort(keys, kind="stable")`` for integer keys in [0, 2**32): two 16-bit digits,
    which numpy sorts by radix (a plan's 240,000 slots at 1,024 GPUs: 16 ms as 64-bit
    integers, 3 ms so); other keys as they are."""
    keys = np.asarray(keys)
    low, high = (int(keys.min()), int(keys.max())) if len(keys) else (0, 0)
    if not len(keys) or low < 0 or high >= 1 << 32:
        return np.argsort(keys, kind="stable")
    if high < 1 << 16:
        return np.argsort(keys.astype(np.uint16), kind="stable")
    return np.lexsort(((keys & 0xFFFF).astype(np.uint16), (keys >> 16).astype(np.uint16)))


def nth_in_run(keys: np.ndarray) -> np.ndarray:
    """Each element's place within its run of equal ``keys`` (sorted or grouped)."""
    index = np.arange(len(keys))
    first = np.ones(len(keys), dtype=bool)
    first[1:] = keys[1:] != keys[:-1]
    return index - np.maximum.accumulate(np.where(first, index, 0))


def _take_in_turn(amount: np.ndarray, group: np.ndarray, limit: np.ndarray) -> np.ndarray:
    """Within each run of equal ``group`` values, take ``amount`` in order until that
    group's ``limit`` (given per element) is used up."""
    total = np.cumsum(amount)
    before = total - amount
    first = np.ones(len(group), dtype=bool)
    first[1:] = group[1:] != group[:-1]
    start = before[np.maximum.accumulate(np.where(first, np.arange(len(group)), 0))]
    return np.clip(limit - (before - start), 0, amount)


def first_balanced(fills: Sequence[Callable[[], tuple[object, np.ndarray]]], loads,
                   gpus: Sequence[int], slots: Sequence[int], alike: float = 1.0,
                   fresh: bool = False,
                   rescues: Sequence[Callable[[], tuple[object, np.ndarray]]] = (),
                   bounds: Sequence[float] | None = None,
                   moved: Callable[[object, np.ndarray], int] | None = None,
                   move_price: float = MOVE_PRICE) -> tuple[object, np.ndarray]:
    """The first of ``fills`` (makers of (what it was made from, [layer, slot] fill), in the
    order to take them) whose every layer has its ranks within ``BALANCE_TARGET``, else the
    most balanced of the first ``FILLS_TRIED`` (for a ``fresh`` plan, of as many more as
    ``FILL_WORK`` allows): the options are ranked on their most fragile layer, and another
    layer may not balance as that one does. A later fill counts as more balanced only by
    more than a factor ``alike``. A lone fill is taken as it is (nothing to fall back on).
    Where none of them balances, ``rescues`` are filled last, in turn, each taken where it
    is more balanced by more than ``BALANCED_ENOUGH`` too (``mro.structure``: the options
    were chosen over it for recovery or for a better balanced most fragile layer;
    ``mro.restructure``: the repair that moves least where the window left it out, and the
    first search's choice made afresh after the repair that ranks first with it).

    A re-plan's fills, rescues too, are weighed on what they move as well (``moved``: the
    replicas a fill's nodes must receive), and the cheapest is taken (``cheapest``: the
    busiest rank priced up by the share of the slots moved, at ``move_price``), not the
    first of balances alike: its options come in the order of what they promise to move,
    but a fill's counts and dealing may move more or less than its anchors did (20 nodes x
    2 GPUs x 3 slots, E = 16, zipf 1.2-1.8 per layer, after losing one: 80 replicas moved
    where another fill as balanced moves 54).

    ``bounds`` (a re-plan's) are the balance of each fill's most fragile layer filled
    alone, the rescues' last: a re-plan's layers do not borrow, so a fill's most fragile
    layer seldom balances better in it. Where fills are costly (more slot-layers than
    ``FILL_WORK`` shares out over ``MOST_FILLS``), a fill whose bound could not be more
    balanced than the best so far by the factor it needs is not made (1,024 GPUs, zipf
    1.5, after losing one node: fills of 1.2, 1.8 and 5.2 s whose bounds were
    1.060-1.063, against a first fill of 1.062); a re-plan's, whose bound, weighed as
    though it moved nothing, could not be cheaper than the cheapest made (``weight``: the
    benchmark's shape on 60 nodes after losing 4, the repair's bound 1.064 against a first
    fill of 1.068 moving 49% of the slots; made, 1.074 moving 17,351 replicas, a third of
    the first fill's 51,116). Cheap fills are all made: the bound leaves out the replicas
    the nodes keep, and with them a fill has come out better (3 of 142 small re-plans,
    e.g. 1.242 against 1.264)."""
    if len(fills) == 1 and not rescues:
        return fills[0]()
    per_rank = [c // g for c, g in zip(slots, gpus)]
    made = []  # a re-plan's fills: (balance, moves, what it was made from, fill)
    best = floor = None  # the fill to take; the least balance of any made

    def balanced(made_from, placements, alike=alike) -> bool:
        nonlocal best, floor
        worst = filled_balance(placements, loads, gpus, per_rank)
        floor = worst if floor is None else min(floor, worst)
        if moved is not None:
            made.append((worst, moved(made_from, placements) / placements.size, made_from,
                         placements))
            best = cheapest(made, move_price)
        elif best is None or max(worst, BALANCE_TARGET) * alike < best[0]:
            best = (max(worst, BALANCE_TARGET), 0, made_from, placements)
        return worst <= BALANCE_TARGET

    def out_of_reach(i: int, alike: float = alike) -> bool:
        if (bounds is None or floor is None
                or sum(slots) * len(best[3]) * MOST_FILLS < FILL_WORK):
            return False
        if moved is None:
            return bounds[i] * alike >= floor
        # A re-plan's fill weighs at least its bound, were it to move nothing: it can be
        # cheaper than the cheapest made only where that is lighter.
        return max(bounds[i], BALANCE_TARGET) * alike >= weight(best, move_price)

    tried = FILLS_TRIED
    for i, make in enumerate(fills):
        if i == tried:
            break
        if out_of_reach(i):
            continue
        made_from, placements = make()
        if fresh and i == 0:  # the work bound needs the number of layers filled
            tried = min(max(FILLS_TRIED, FILL_WORK // (sum(slots) * len(placements))),
                        MOST_FILLS)
        if balanced(made_from, placements):
            return best[2], best[3]
    alike = max(alike, BALANCED_ENOUGH)
    for i, rescue in enumerate(rescues, start=len(fills)):
        if not out_of_reach(i, alike) and balanced(*rescue(), alike=alike):
            break
    return best[2], best[3]


def cheapest(made: Sequence[tuple], move_price: float = MOVE_PRICE) -> tuple:
    """Of a re-plan's fills (balance, share of the slots it moves, ...), the one whose
    busiest rank, counted as within ``BALANCE_TARGET`` where it is, weighs least once
    priced up by what it moves (times 1 + ``move_price`` x the share); of equal weight,
    the one moving less."""
    return min(made, key=lambda m: (weight(m, move_price), m[1]))


def weight(m: tuple, move_price: float) -> float:
    """A re-plan's fill (balance, share of the slots it moves, ...) weighed as ``cheapest``
    does: its busiest rank, counted as ``BALANCE_TARGET`` where within, times 1 +
    ``move_price`` x the share."""
    return max(m[0], BALANCE_TARGET) * (1 + move_price * m[1])


def busiest_rank(plan, loads: Sequence[Sequence[float]]) -> float:
    """The worst layer's busiest rank over its mean rank, under ``loads[l][e]`` (each
    replica of e carries t_e / r_e): what a plan's step time answers to. 1.0 is perfect."""
    # Slot s of a node belongs to its rank s // slots_per_rank (plan.py).
    ranks = np.concatenate([np.repeat(np.asarray(n.ranks, dtype=np.int64), n.slots_per_rank)
                            for n in plan.nodes])
    return _busiest(plan.slot_matrix, [layer.replicas for layer in plan.layers], loads, ranks,
                    plan.world_size)


def filled_balance(placements: np.ndarray, loads: Sequence[Sequence[float]],
                   ranks_per_node: Sequence[int], slots_per_rank: Sequence[int]) -> float:
    """``busiest_rank`` of a [layer, slot] fill (``fill_layers``'s order), with the counts
    it holds."""
    return max(1.0, float(layer_balance(placements, loads, ranks_per_node,
                                        slots_per_rank).max(initial=1.0)))


def layer_balance(placements: np.ndarray, loads: Sequence[Sequence[float]],
                  ranks_per_node: Sequence[int], slots_per_rank: Sequence[int]) -> np.ndarray:
    """Per layer of a [layer, slot] fill: its busiest rank over its mean (1.0 without
    load)."""
    g = np.asarray(ranks_per_node, dtype=np.int64)
    ranks = np.repeat(np.arange(int(g.sum())), np.repeat(slots_per_rank, g))
    return _per_layer(placements, fill_counts(placements, len(loads[0])), loads, ranks,
                      int(g.sum()))


def fill_counts(placements: np.ndarray, experts: int) -> np.ndarray:
    """[layer, expert]: the replicas a [layer, slot] fill holds (with ``trade`` they may
    differ from the counts it was given)."""
    offsets = np.arange(len(placements))[:, None] * experts
    return np.bincount((placements + offsets).ravel(),
                       minlength=len(placements) * experts).reshape(-1, experts)


def _busiest(slots: np.ndarray, replicas, loads, rank_of_slot: np.ndarray,
             num_ranks: int) -> float:
    return max(1.0, float(_per_layer(slots, replicas, loads, rank_of_slot,
                                     num_ranks).max(initial=1.0)))


def _per_layer(slots: np.ndarray, replicas, loads, rank_of_slot: np.ndarray,
               num_ranks: int) -> np.ndarray:
    t = np.asarray(loads, dtype=np.float64)
    r = np.asarray(replicas, dtype=np.float64)
    w = np.divide(t, r, out=np.zeros_like(t), where=r > 0)
    num_layers = len(slots)
    # A flat gather: ``np.take_along_axis`` builds an index per axis (1,024 GPUs' 230,000
    # slots: 1 ms against 0.3).
    per_slot = np.take(w.ravel(), slots + np.arange(num_layers)[:, None] * w.shape[1])
    per_rank = np.bincount((np.arange(num_layers)[:, None] * num_ranks + rank_of_slot).ravel(),
                           weights=per_slot.ravel(),
                           minlength=num_layers * num_ranks).reshape(num_layers, num_ranks)
    ratios = np.ones(num_layers)
    loaded = t.sum(axis=1) > 0
    ratios[loaded] = per_rank[loaded].max(axis=1) / per_rank[loaded].mean(axis=1)
    return ratios
