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
   node, kept replicas too unless the ranks are still more than ``BALANCE_TARGET`` apart.

Ranks follow plan.py: slot s of a node belongs to its rank s // slots_per_rank.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Placement = list[list[int]]

# A busiest rank within 1% of the mean is not worth more swaps.
BALANCED_ENOUGH = 1.01
# On a re-plan, replicas a node already holds move for balance only while the busiest rank
# is more than 5% above the mean: past that, a step costs more than the transfer.
BALANCE_TARGET = 1.05
# Work bounds of the swap rounds (they stop sooner once nothing gains).
MAX_ROUNDS = 64
PATIENCE = 4
STALLED_ROUNDS = 8


def fill(replicas: Sequence[int], anchored: Sequence[tuple[int, int]], weights: Sequence[float],
         ranks_per_node: Sequence[int], slots_per_rank: Sequence[int],
         reference: np.ndarray | None = None) -> Placement:
    """One layer's placement: node position -> expert ids, one per slot, rank by rank.

    ``reference[node, e]``: replicas of e that the node at that position holds already.
    """
    r = np.asarray(replicas, dtype=np.int64)
    w = np.asarray(weights, dtype=np.float64)
    g = np.asarray(ranks_per_node, dtype=np.int64)
    s = np.asarray(slots_per_rank, dtype=np.int64)
    n, num_experts = len(g), len(r)
    capacity = g * s
    assert r.sum() == capacity.sum(), "replicas must fill every slot"

    pinned = np.zeros((n, num_experts), dtype=np.int64)
    if len(anchored):
        a = np.asarray(anchored, dtype=np.int64)
        np.add.at(pinned, (a[:, 1], a[:, 0]), 1)
    anchors = pinned.copy()
    if reference is not None:
        pinned += _kept(reference, pinned, r, capacity)

    # 2. Pinned replicas onto their node's ranks, heaviest first, in snake order.
    nodes, experts = np.nonzero(pinned)
    counts = pinned[nodes, experts]
    nodes, experts = np.repeat(nodes, counts), np.repeat(experts, counts)
    by_node = np.lexsort((experts, -w[experts], nodes))
    nodes, experts = nodes[by_node], experts[by_node]
    # The first anchors[node, e] copies of each (node, e) are anchors, the rest kept.
    first = np.ones(len(nodes), dtype=bool)
    first[1:] = (nodes[1:] != nodes[:-1]) | (experts[1:] != experts[:-1])
    starts_of_run = np.maximum.accumulate(np.where(first, np.arange(len(nodes)), 0))
    anchor = (np.arange(len(nodes)) - starts_of_run) < anchors[nodes, experts]
    starts = np.searchsorted(nodes, np.arange(n))
    k = np.arange(len(nodes)) - starts[nodes]
    gi = g[nodes]
    turn, pos = k // gi, k % gi
    rank_base = np.concatenate(([0], np.cumsum(g)[:-1]))
    ranks = rank_base[nodes] + np.where(turn % 2 == 0, pos, gi - 1 - pos)

    num_ranks = int(g.sum())
    rank_slots = np.repeat(s, g)
    load = np.bincount(ranks, weights=w[experts], minlength=num_ranks)
    room = rank_slots - np.bincount(ranks, minlength=num_ranks)

    # 3. The rest in rounds: heaviest replicas to the least loaded ranks with room.
    free = r - pinned.sum(axis=0)
    rest = np.repeat(np.arange(num_experts), free)
    rest = rest[np.lexsort((rest, -w[rest]))]
    rest_ranks = np.empty(len(rest), dtype=np.int64)
    done = 0
    while done < len(rest):
        open_ranks = np.flatnonzero(room)
        take = min(len(open_ranks), len(rest) - done)
        lightest = open_ranks[np.argsort(load[open_ranks] / rank_slots[open_ranks],
                                         kind="stable")[:take]]
        batch = rest[done:done + take]
        rest_ranks[done:done + take] = lightest
        load[lightest] += w[batch]
        room[lightest] -= 1
        done += take

    all_experts = np.concatenate((experts, rest))
    all_ranks = np.concatenate((ranks, rest_ranks))
    rank_node = np.repeat(np.arange(n), g)
    free = np.full(len(rest), -1)
    homes = [(np.concatenate((nodes, free)), BALANCED_ENOUGH)]
    if reference is not None:
        # Still out of balance: kept replicas may move after all, each one a transfer.
        homes.append((np.concatenate((np.where(anchor, nodes, -1), free)), BALANCE_TARGET))
    for home, enough in homes:
        _exchange(all_ranks, w[all_experts], home, rank_node, load, rank_slots, enough)
    flat = all_experts[np.argsort(all_ranks, kind="stable")].tolist()
    bounds = np.concatenate(([0], np.cumsum(capacity))).tolist()
    return [flat[bounds[i]:bounds[i + 1]] for i in range(n)]


def _exchange(ranks: np.ndarray, weights: np.ndarray, home: np.ndarray, rank_node: np.ndarray,
              load: np.ndarray, rank_slots: np.ndarray, enough: float) -> None:
    """Pair the busier half of the ranks with the lighter half, and in every pair at once
    make the one swap of two replicas that lowers the pair's larger load the most
    (``ranks`` in place). Round t pairs the i-th busiest with the (i + t)-th lightest, so
    a busy rank meets other partners; stop after ``PATIENCE`` rounds in a row gain nothing
    or ``STALLED_ROUNDS`` leave the busiest rank as it was.
    A replica pinned to a node (``home`` >= 0) only trades places with replicas on that
    node; the others trade with any free replica. Stops as soon as every busy rank is
    within ``enough`` times the mean."""
    num_ranks = len(load)
    order = np.argsort(ranks, kind="stable")
    counts = np.bincount(ranks, minlength=num_ranks)
    width = int(counts.max()) if len(counts) else 0
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    slot_of = np.full((num_ranks, width), -1, dtype=np.int64)
    column = np.arange(len(ranks)) - starts[ranks[order]]
    slot_of[ranks[order], column] = order
    mean = load.sum() / rank_slots.sum()
    padded_w = np.append(weights, np.nan)
    padded_home = np.append(home, -2)
    half = num_ranks // 2
    idle = stalled = 0
    busiest = np.inf
    for t in range(MAX_ROUNDS):
        per_slot = load / rank_slots
        # Only the busiest rank sets the step time: stop once rounds leave it be.
        stalled = stalled + 1 if per_slot.max() >= busiest - 1e-12 else 0
        busiest = min(busiest, per_slot.max())
        if idle >= min(half, PATIENCE) or stalled >= STALLED_ROUNDS:
            return
        by_load = np.argsort(per_slot, kind="stable")
        heavy, light = by_load[::-1][:half], np.roll(by_load[:half], -(t % max(half, 1)))
        busy = per_slot[heavy] > enough * mean
        heavy, light = heavy[busy], light[busy]
        if not len(heavy):
            return
        xh, xl = slot_of[heavy], slot_of[light]
        d = padded_w[xh][:, :, None] - padded_w[xl][:, None, :]
        hh, hl = padded_home[xh][:, :, None], padded_home[xl][:, None, :]
        node = rank_node[heavy][:, None, None]
        same = node == rank_node[light][:, None, None]
        ok = (d > 0) & (((hh == -1) & (hl == -1))
                        | (same & ((hh == -1) | (hh == node)) & ((hl == -1) | (hl == node))))
        after = np.maximum((load[heavy][:, None, None] - d) / rank_slots[heavy][:, None, None],
                           (load[light][:, None, None] + d) / rank_slots[light][:, None, None])
        after = np.where(ok, after, np.inf).reshape(len(heavy), -1)
        pick = np.argmin(after, axis=1)
        gain = after[np.arange(len(heavy)), pick] < per_slot[heavy] - 1e-12
        idle = 0 if gain.any() else idle + 1
        heavy, light, pick = heavy[gain], light[gain], pick[gain]
        a, b = pick // width, pick % width
        x, y = slot_of[heavy, a], slot_of[light, b]
        delta = weights[x] - weights[y]
        load[heavy] -= delta
        load[light] += delta
        ranks[x], ranks[y] = light, heavy
        slot_of[heavy, a], slot_of[light, b] = y, x


def _kept(reference: np.ndarray, pinned: np.ndarray, replicas: np.ndarray,
          capacity: np.ndarray) -> np.ndarray:
    """Replicas each node keeps from ``reference``: no more per expert than the new count
    leaves after the anchors, no more per node than its slots left after its anchors."""
    spare = np.maximum(reference - pinned, 0)
    free = replicas - pinned.sum(axis=0)
    before = np.cumsum(spare, axis=0) - spare
    kept = np.clip(free[None, :] - before, 0, spare)
    room = capacity - pinned.sum(axis=1)
    before = np.cumsum(kept, axis=1) - kept
    return np.clip(room[:, None] - before, 0, kept)


def rank_loads(placement: Placement, weights: Sequence[float],
               slots_per_rank: Sequence[int]) -> list[float]:
    """Expert work per rank, rank by rank in node order."""
    out = []
    for experts, c in zip(placement, slots_per_rank):
        for i in range(0, len(experts), c):
            out.append(sum(weights[e] for e in experts[i:i + c]))
    return out
