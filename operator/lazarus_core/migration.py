"""Migration planning: after a change, which node plays which plan position, and what moves.

The new plan's positions are interchangeable as far as recovery goes, so physical nodes can
be matched to them freely (within the same zone and slot count). We choose the matching
that keeps the most expert replicas where they already are: a linear assignment problem,
solved exactly (the paper's greedy mapping is kept as the baseline we measure against).
Every replica a node still lacks becomes one transfer from a surviving holder, with sources
spread so that no holder serves more than its share.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .plan import Plan, Transfer, replica_counts
from .topology import NodeSpec

Placement = list[list[int]]

# A mapping across zones or slot counts would change the plan's failure domains.
_FORBIDDEN = 1e9


@dataclass(frozen=True)
class Migration:
    transfers: tuple[Transfer, ...]
    # (layer, expert) pairs that no surviving node holds: only a checkpoint can restore them.
    lost: tuple[tuple[int, int], ...]

    @property
    def recoverable(self) -> bool:
        return not self.lost

    @property
    def experts_migrated(self) -> int:
        return len(self.transfers)


def holdings(plan: Plan) -> dict[str, list[set[int]]]:
    """Node name -> per layer, the experts it holds."""
    return {
        node.name: [set(layer.placement[i]) for layer in plan.layers]
        for i, node in enumerate(plan.nodes)
    }


def _retained(old: Plan, nodes: Sequence[NodeSpec], layers: Sequence[Placement]) -> np.ndarray:
    """retained[i, q]: replicas node i already holds of what position q needs."""
    row = {n.name: i for i, n in enumerate(old.nodes)}
    rows = np.array([row.get(n.name, -1) for n in nodes])
    # [node, layer * expert]: does the node hold it (before), does the position need it (after)
    before = np.concatenate([layer.counts > 0 for layer in old.layers], axis=1)
    before = np.where((rows >= 0)[:, None], before[np.maximum(rows, 0)], False)
    after = np.concatenate([replica_counts(p, old.experts) > 0 for p in layers], axis=1)
    return before.astype(np.int64) @ after.T.astype(np.int64)


def _compatible(nodes: Sequence[NodeSpec], positions: Sequence[NodeSpec]) -> np.ndarray:
    return np.array([[a.zone == b.zone and a.slots == b.slots for b in positions]
                     for a in nodes], dtype=bool)


def map_nodes_optimal(old: Plan, nodes: Sequence[NodeSpec], positions: Sequence[NodeSpec],
                      layers: Sequence[Placement]) -> list[int]:
    """position -> index into ``nodes``, keeping the most replicas in place."""
    # scipy is imported here, not at the top: it doubles the start-up time of every
    # `lazarus` command, and only a re-plan of spread or compact placements gets here.
    from scipy.optimize import linear_sum_assignment

    gain = _retained(old, nodes, layers)
    cost = np.where(_compatible(nodes, positions), -gain, _FORBIDDEN)
    rows, cols = linear_sum_assignment(cost)
    mapping = [0] * len(positions)
    for r, c in zip(rows, cols):
        mapping[c] = r
    return mapping


def map_nodes_greedy(old: Plan, nodes: Sequence[NodeSpec], positions: Sequence[NodeSpec],
                     layers: Sequence[Placement]) -> list[int]:
    """The paper's mapping: each position in turn takes the free node that keeps the most."""
    gain = _retained(old, nodes, layers)
    ok = _compatible(nodes, positions)
    taken: set[int] = set()
    mapping = []
    for q in range(len(positions)):
        best = max((i for i in range(len(nodes)) if i not in taken and ok[i, q]),
                   key=lambda i: (gain[i, q], -i))
        taken.add(best)
        mapping.append(best)
    return mapping


def plan_transfers(old: Plan, new: Plan, sources: set[str]) -> Migration:
    """Transfers that give every node of ``new`` the experts it lacks.

    ``sources`` names the old nodes still able to send: survivors, plus a node under a spot
    notice that is leaving the plan but is still alive. Transfers are listed destination by
    destination, layer by layer, expert by expert. The i-th transfer of a (layer, expert)
    comes from its holders in turn, starting at a holder that differs from one
    (layer, expert) to the next, so every holder sends its share.
    """
    names = [n.name for n in old.nodes]
    rows = [i for i, name in enumerate(names) if name in sources]
    # [holder, expert] per layer, from the counts the plan keeps (no pass over its slots).
    present = [layer.counts[rows] > 0 for layer in old.layers]
    return _transfers([names[i] for i in rows], present, new)


def transfers_for(held: Mapping[str, Sequence[set[int]]], new: Plan) -> Migration:
    """Transfers that give every node of ``new`` the experts it lacks, from ``held``: what
    each node able to send holds, per layer (listed and sourced as ``plan_transfers``)."""
    names = list(held)
    present = [np.zeros((len(names), new.experts), dtype=bool) for _ in new.layers]
    for i, name in enumerate(names):
        for li, experts in enumerate(held[name]):
            present[li][i, list(experts)] = True
    return _transfers(names, present, new)


def _transfers(names: Sequence[str], present: Sequence[np.ndarray], new: Plan) -> Migration:
    """The transfers from holders ``names`` (``present[l][holder, e]``: holds e in layer l)
    to every node of ``new`` that lacks an expert its slots name."""
    row = {name: i for i, name in enumerate(names)}
    # Destinations' rows among the holders (-1: none; what a holder has, it does not receive).
    had_row = np.array([row.get(n.name, -1) for n in new.nodes], dtype=np.int64)
    experts = new.experts
    needed = []
    for before, new_layer in zip(present, new.layers):
        nothing = np.zeros((1, experts), dtype=bool)  # row -1: a destination holding nothing
        had = np.concatenate((before, nothing))[had_row]
        needed.append((new_layer.counts > 0) & ~had)
    wants = np.stack(needed, axis=1)  # [destination, layer, expert]
    dest, layer, expert = np.nonzero(wants)
    # The (layer, expert) groups something is wanted of, and their holders as one flat list
    # with offsets (only theirs: most groups need nothing).
    wanted, group = np.unique(layer * experts + expert, return_inverse=True)
    holds = np.concatenate([p.T for p in present])[wanted]  # [wanted group, holder]
    count = holds.sum(axis=1)
    start = np.concatenate(([0], np.cumsum(count)[:-1]))
    holder_list = np.append(np.nonzero(holds)[1], -1)  # -1: a sentinel for lost groups
    # The i-th transfer of its group, in listing order.
    order = np.argsort(group, kind="stable")
    nth = np.empty(len(group), dtype=np.int64)
    firsts = np.concatenate(([True], group[order][1:] != group[order][:-1]))
    run_start = np.maximum.accumulate(np.where(firsts, np.arange(len(order)), 0))
    nth[order] = np.arange(len(order)) - run_start
    ok = count[group] > 0
    turn = np.where(ok, (wanted[group] + nth) % np.maximum(count[group], 1), 0)
    src = np.where(ok, holder_list[np.where(ok, start[group] + turn, -1)], -1)
    new_names = [n.name for n in new.nodes]
    transfers = tuple(Transfer(int(l), int(e), names[s], new_names[d])
                      for d, l, e, s in zip(dest.tolist(), layer.tolist(), expert.tolist(),
                                            src.tolist()) if s >= 0)
    lost = sorted({(int(l), int(e)) for l, e in zip(layer[~ok].tolist(), expert[~ok].tolist())})
    return Migration(transfers, tuple(lost))
