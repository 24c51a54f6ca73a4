"""An annealed search for a small re-plan's placement that copies fewer replicas.

A re-plan's fill balances first and prefers the nodes that hold an expert second; the
swaps that follow it (``swap_back.py``) return only pairs of copies that trade places. At
the paper's setting (10 nodes of 6 slots, E = 16, 12 layers, 4 lost) that leaves the
re-plan copying 235 replicas on average over bench_solver's 8 draws, where an integer
program over the same pairs of nodes, counts and per-layer busiest rank found 144-216 on
5 of them that the fill copied 216-242 on (SciPy's HiGHS, used only to measure this, not
shipped). The cheaper placements move several replicas at once (a cold expert to the
pair of nodes that holds it, the hot replicas there out of its way, twins of a hot expert
on one node), which no single swap that keeps every rank in bounds reaches.

This pass anneals each layer over two kinds of step:

- two slots on different nodes exchange their replicas;
- an expert with one replica on each node of its core moves to another core of the
  layer's as large and disjoint from it, exchanging with one slot on each of its nodes.

A state is worth its copies (the (node, expert)s placed that the node did not hold) plus
``OVERLOAD_PRICE`` copies for each 1% by which its busiest rank passes the layer's
busiest before the pass; the best state with no rank past it is kept, and only where it
copies fewer. Every step keeps each expert's nodes a superset of a core of the layer
before the pass (a minimal node set of fewer than ``largest`` nodes: an expert on none
keeps ``largest`` nodes, as ``swap_back.py`` keeps them), so every set of failed nodes
that loses an expert afterwards lost one before: recovery can only improve. The counts,
and how many slots each rank has, do not change.

The search makes ``STEPS_PER_SLOT`` steps for each slot of each layer, fewer where that
would pass ``MOST_STEPS`` (5-10 microseconds a step in CPython), and none where that
leaves fewer than ``FEWEST_STEPS`` a slot: at 1,024 GPUs a re-plan carries its plan over
(``carry.py``) and copies fewer replicas than the lost nodes held. Seeded by the layer's
index: a re-plan is the same each time.
"""
from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np

from .anchors import smallest_cores

# Steps for each slot of each layer, and at most this many in a re-plan (0.3-0.5 s);
# where that leaves fewer than FEWEST_STEPS a slot, the search is not made (past 2,000
# slots over all layers). The job waits on the re-plan and then on its copies: the
# paper's Table 2 copied 160 GPT-L experts in 7.6 s, 48 ms each. At the paper's setting
# 100,000 steps copied 211.9 on average for 0.5 s more than 50,000 (213.9), which is
# worth 10 copies (stop 53, docs/placement.md).
STEPS_PER_SLOT = 300
MOST_STEPS = 50_000
FEWEST_STEPS = 25
# Copies a state pays for each 1% of the mean rank load its busiest rank runs over.
OVERLOAD_PRICE = 0.5
# The temperature at the first step, in copies; it falls linearly to 0.
START_TEMPERATURE = 0.3
# The share of steps that move an expert to another core.
CORE_STEPS = 0.7


def with_fewer_copies(placements: np.ndarray, held: np.ndarray, weights: np.ndarray,
                      slots_per_node: Sequence[int], slots_per_rank: Sequence[int],
                      largest: int) -> np.ndarray:
    """``placements`` ([layer, slot], node by node, rank by rank) with each layer annealed
    where that copies fewer, or as they are where the re-plan is too large to search.

    ``held[l, node, e]``: the node at that position holds e already; ``weights[l, e]``: the
    load each replica of e carries in layer l."""
    num_layers, num_slots = placements.shape
    per_slot = min(STEPS_PER_SLOT, MOST_STEPS // max(num_layers * num_slots, 1))
    if per_slot < FEWEST_STEPS:
        return placements
    node_of = np.repeat(np.arange(len(slots_per_node)), slots_per_node)
    per_rank = np.repeat(slots_per_rank, np.asarray(slots_per_node) // slots_per_rank)
    rank_of = np.repeat(np.arange(len(per_rank)), per_rank)
    out = placements.copy()
    for li in range(num_layers):
        out[li] = _Layer(out[li], held[li], weights[li], node_of, rank_of,
                         largest).annealed(random.Random(li), per_slot * num_slots)
    return out


class _Layer:
    """One layer's slots as a search state: what each slot holds, the replicas each node
    has of each expert, each rank's load and the copies the state makes."""

    def __init__(self, row: np.ndarray, held: np.ndarray, weight: np.ndarray,
                 node_of: np.ndarray, rank_of: np.ndarray, largest: int):
        n, experts = held.shape
        self.experts = experts
        self.row = row.tolist()
        self.held = held.ravel().tolist()  # node * experts + expert, as ``count``
        self.weight = weight.tolist()
        self.node_of, self.rank_of = node_of.tolist(), rank_of.tolist()
        self.largest = largest
        count = np.zeros((n, experts), dtype=np.int64)
        np.add.at(count, (node_of, row), 1)
        self.count = count.ravel().tolist()
        self.spread = (count > 0).sum(axis=0).tolist()
        cores, which = smallest_cores((count > 0).T, largest - 1)
        members = [tuple(np.flatnonzero(c).tolist()) for c in cores]
        self.core = [members[c] if c >= 0 else None for c in which.tolist()]
        # The cores each core's experts may move to: as large, and on other nodes.
        self.partners = {c: [d for d in members if len(d) == len(c) and not set(c) & set(d)]
                         for c in members}
        self.movable = [e for e, c in enumerate(self.core) if c and self.partners[c]]
        # Each node's slots, first and one past the last (a node's slots are side by side).
        self.span = [(int(a), int(b)) for a, b in zip(
            np.searchsorted(node_of, np.arange(n)), np.searchsorted(node_of, np.arange(n),
                                                                    side="right"))]
        self.load = np.bincount(rank_of, weights=weight[row]).tolist()
        self.copies = int(((count > 0) & ~held).sum())

    def annealed(self, rng: random.Random, steps: int) -> np.ndarray:
        """The state with fewest copies found whose busiest rank is no busier than at
        the start, over ``steps`` steps (the row as it was where none copies fewer)."""
        load = self.load
        cap = max(load) * (1 + 1e-12)
        price = OVERLOAD_PRICE * 100 * len(load) / max(sum(load), 1e-300)
        cost = float(self.copies)
        best, best_row = self.copies, list(self.row)
        for step in range(steps):
            if not best:  # nothing left to save
                break
            undo = []
            if self.movable and rng.random() < CORE_STEPS:
                pairs = self._core_step(rng, undo)
            else:
                pairs = self._slot_step(rng)
            if not pairs:
                continue
            change, shift, copied, spread = self._change(pairs)
            after = load[:]
            for r, by in shift.items():
                after[r] += by
            top = max(after)
            new = self.copies + copied + (price * (top - cap) if top > cap else 0.0)
            if (new <= cost or rng.random() < math.exp(
                    (cost - new) / (START_TEMPERATURE * (1 - step / steps)))) and all(
                        self._recovers(e, change, spread) for e in spread.keys() | {
                            key % self.experts for key in change}):
                self._apply(pairs, change, shift, spread)
                self.copies += copied
                cost = new
                if top <= cap and self.copies < best:
                    best, best_row = self.copies, list(self.row)
            else:
                for e, core in undo:
                    self.core[e] = core
        return np.array(best_row, dtype=np.int64)

    def _slot_step(self, rng: random.Random) -> list[tuple[int, int]]:
        s, t = int(rng.random() * len(self.row)), int(rng.random() * len(self.row))
        if self.node_of[s] == self.node_of[t] or self.row[s] == self.row[t]:
            return []
        return [(s, t)]

    def _core_step(self, rng: random.Random, undo: list) -> list[tuple[int, int]]:
        """An expert with one replica on each node of its core moved onto another core
        as large and on other nodes (its core changes with it, and an expert there that
        the step moves whole takes the old one; ``undo`` gets what they were): the slot
        pairs to exchange, or [] where the expert drawn has other replicas there."""
        x = _drawn(rng, self.movable)
        mine = self.core[x]
        if any(self.count[i * self.experts + x] != 1 for i in mine):
            return []
        other = _drawn(rng, self.partners[mine])
        src = [self.row.index(x, *self.span[i]) for i in mine]
        dst = [int(a + rng.random() * (b - a)) for a, b in map(self.span.__getitem__, other)]
        if rng.random() < 0.5:
            dst.reverse()
        undo.append((x, mine))
        self.core[x] = other
        displaced = {self.row[t] for t in dst}
        if len(displaced) == 1:
            y = displaced.pop()
            if self.core[y] == other:
                undo.append((y, other))
                self.core[y] = mine
        return list(zip(src, dst))

    def _change(self, pairs: list[tuple[int, int]]):
        """What exchanging each pair of slots' replicas would change: the replicas of each
        (node, expert) (keyed node * experts + expert), each rank's load, the copies made
        (< 0: saved), each expert's nodes."""
        change: dict[int, int] = {}
        shift: dict[int, float] = {}
        row, node_of, rank_of, weight = self.row, self.node_of, self.rank_of, self.weight
        experts, get = self.experts, change.get
        for s, t in pairs:
            x, y = row[s], row[t]
            a, b = node_of[s] * experts, node_of[t] * experts
            change[a + x] = get(a + x, 0) - 1
            change[b + y] = get(b + y, 0) - 1
            change[b + x] = get(b + x, 0) + 1
            change[a + y] = get(a + y, 0) + 1
            moved = weight[y] - weight[x]
            shift[rank_of[s]] = shift.get(rank_of[s], 0.0) + moved
            shift[rank_of[t]] = shift.get(rank_of[t], 0.0) - moved
        copied = 0
        spread: dict[int, int] = {}
        count, held = self.count, self.held
        for key, by in change.items():
            if by and (count[key] > 0) != (count[key] + by > 0):
                gone = count[key] > 0
                e = key % experts
                spread[e] = spread.get(e, 0) + (-1 if gone else 1)
                if not held[key]:
                    copied += -1 if gone else 1
        return change, shift, copied, spread

    def _apply(self, pairs, change, shift, spread) -> None:
        row = self.row
        for s, t in pairs:
            row[s], row[t] = row[t], row[s]
        for key, by in change.items():
            self.count[key] += by
        for e, by in spread.items():
            self.spread[e] += by
        for r, by in shift.items():
            self.load[r] += by

    def _recovers(self, e: int, change, spread) -> bool:
        """Whether expert e would still be on a superset of its core (or on ``largest``
        nodes)."""
        core = self.core[e]
        if core is None:
            return self.spread[e] + spread.get(e, 0) >= self.largest
        experts, count = self.experts, self.count
        return all(count[i * experts + e] + change.get(i * experts + e, 0) > 0 for i in core)


def _drawn(rng: random.Random, items: list):
    """One of ``items`` at random (``Random.choice`` is several times slower)."""
    return items[int(rng.random() * len(items))]
