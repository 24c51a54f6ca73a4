"""Swapping a re-plan's replicas back to nodes that held them, where nothing else changes.

A re-plan's fill places replicas for balance, and two nodes may each receive an expert
that the other already held: node A gets x (a copy) while node B, which held x, gets y,
which A held. Swapping the two slots moves neither, or one fewer where B did not hold x,
and this pass makes every such swap that

- leaves every rank of the layer at or below its busiest rank before the first pass (no
  layer's step gets slower), and
- touches only experts on at least ``largest`` nodes (``anchor_search.largest_core``),
  where neither expert has a twin on the node it leaves or a replica on the node it
  joins: each keeps as many nodes as before, and an expert on that many nodes has no
  fatal set at the failure counts scored, so recovery stays exactly as it was.

Swaps that save two copies go first, then those that save one; a swap that saves one
leaves a copy elsewhere that may go back in turn, so the pass repeats while it swaps (up
to ``ROUNDS`` times). Pure logic on arrays: the solver (``solver.replan``) runs it on
every re-plan it fills afresh.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Passes over a layer at most (the benchmark's shape on 48-60 nodes: the second pass saves
# about 1% more, later ones a few replicas).
ROUNDS = 8


def swapped_back(placements: np.ndarray, held: np.ndarray, weights: np.ndarray,
                 slots_per_node: Sequence[int], slots_per_rank: Sequence[int],
                 largest: int) -> np.ndarray:
    """``placements`` ([layer, slot], node by node, rank by rank) with the swaps made.

    ``held[l, node, e]``: the node at that position holds e already (what it keeps costs
    no copy); ``weights[l, e]``: the load each replica of e carries in layer l.
    """
    out = placements.copy()
    node_of = np.repeat(np.arange(len(slots_per_node)), slots_per_node)
    per_rank = np.repeat(slots_per_rank, np.asarray(slots_per_node) // slots_per_rank)
    rank_of = np.repeat(np.arange(len(per_rank)), per_rank)
    for li in range(out.shape[0]):
        cap = np.bincount(rank_of, weights=weights[li][out[li]]).max()
        for _ in range(ROUNDS):
            if not _swap_layer(out[li], held[li], weights[li], node_of, rank_of, largest,
                               cap):
                break
    return out


def _swap_layer(row: np.ndarray, held: np.ndarray, weight: np.ndarray, node_of: np.ndarray,
                rank_of: np.ndarray, largest: int, cap: float) -> int:
    """One pass of the swaps of a layer, in place, none lifting a rank above ``cap`` (the
    layer's busiest rank before the first pass); how many it made."""
    n, experts = held.shape
    count = np.zeros((n, experts), dtype=np.int64)
    np.add.at(count, (node_of, row), 1)
    spread = (count > 0).sum(axis=0)
    # Slots whose replica is a copy, of an expert alone on its node and on enough nodes.
    copied = np.flatnonzero(~held[node_of, row] & (count[node_of, row] == 1)
                            & (spread[row] >= largest))
    if len(copied) < 2:
        return 0
    load = np.bincount(rank_of, weights=weight[row])
    by_expert: dict[int, list[int]] = {}
    for s in copied.tolist():
        by_expert.setdefault(int(row[s]), []).append(s)
    done: set[int] = set()
    for both in (True, False):
        for s in copied.tolist():
            if s in done:
                continue
            a, x = int(node_of[s]), int(row[s])
            # Experts a held and no longer has, placed as copies elsewhere.
            for y in np.flatnonzero(held[a] & (count[a] == 0)).tolist():
                partner = next((t for t in by_expert.get(y, ()) if t not in done
                                and _fits(s, t, x, y, held, count, node_of, rank_of, load,
                                          weight, cap, both)), None)
                if partner is None:
                    continue
                b = int(node_of[partner])
                row[s], row[partner] = y, x
                shift = weight[y] - weight[x]
                load[rank_of[s]] += shift
                load[rank_of[partner]] -= shift
                count[a, x] -= 1
                count[a, y] += 1
                count[b, y] -= 1
                count[b, x] += 1
                done.update((s, partner))
                break
    return len(done) // 2


def _fits(s: int, t: int, x: int, y: int, held, count, node_of, rank_of, load, weight,
          cap: float, both: bool) -> bool:
    """Whether slot ``s`` (x, a copy) may swap with slot ``t`` (y, a copy): its node does
    not hold x now, holds it from before where ``both`` savings are asked for, and neither
    rank passes ``cap``."""
    b = node_of[t]
    if b == node_of[s] or count[b, x] or (both and not held[b, x]):
        return False
    shift = weight[y] - weight[x]
    return load[rank_of[s]] + shift <= cap and load[rank_of[t]] - shift <= cap
