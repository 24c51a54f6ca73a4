"""Migration planning: after a change, which node plays which plan position, and what moves.

The new plan's positions are interchangeable as far as recovery goes, so physical nodes can
be matched to them freely (within the same zone and slot count). We choose the matching
that keeps the most expert replicas where they already are: a linear assignment problem,
solved exactly (the paper's greedy mapping is kept as the baseline we measure against).
Every replica a node still lacks becomes one transfer from a surviving holder, with sources
spread so that no holder serves more than its share.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import sparse
from scipy.optimize import linear_sum_assignment

from .plan import Plan, Transfer
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


def presence_matrix(held: Sequence[Sequence[set[int]]], experts: int) -> sparse.csr_matrix:
    """Rows: nodes; columns: (layer, expert); 1 where the node holds that expert."""
    num_layers = len(held[0]) if held else 0
    rows, cols = [], []
    for i, per_layer in enumerate(held):
        for li, es in enumerate(per_layer):
            cols.extend(li * experts + e for e in es)
            rows.extend([i] * len(es))
    data = np.ones(len(rows), dtype=np.float64)
    return sparse.csr_matrix((data, (rows, cols)), shape=(len(held), num_layers * experts))


def _retained(old: Plan, nodes: Sequence[NodeSpec], layers: Sequence[Placement]) -> np.ndarray:
    """retained[i, q]: replicas node i already holds of what position q needs."""
    experts = old.experts
    before = holdings(old)
    empty = [set() for _ in layers]
    old_m = presence_matrix([before.get(n.name, empty) for n in nodes], experts)
    new_m = presence_matrix(
        [[set(layer[q]) for layer in layers] for q in range(len(nodes))], experts)
    return (old_m @ new_m.T).toarray()


def _compatible(nodes: Sequence[NodeSpec], positions: Sequence[NodeSpec]) -> np.ndarray:
    return np.array([[a.zone == b.zone and a.slots == b.slots for b in positions]
                     for a in nodes], dtype=bool)


def map_nodes_optimal(old: Plan, nodes: Sequence[NodeSpec], positions: Sequence[NodeSpec],
                      layers: Sequence[Placement]) -> list[int]:
    """position -> index into ``nodes``, keeping the most replicas in place."""
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
    notice that is leaving the plan but is still alive.
    """
    return transfers_for({n: h for n, h in holdings(old).items() if n in sources}, new)


def transfers_for(held: Mapping[str, Sequence[set[int]]], new: Plan) -> Migration:
    """Transfers that give every node of ``new`` the experts it lacks, from ``held``: what
    each node able to send holds, per layer."""
    holders: dict[tuple[int, int], list[str]] = defaultdict(list)
    for name, per_layer in held.items():
        for li, es in enumerate(per_layer):
            for e in es:
                holders[li, e].append(name)
    sends: dict[str, int] = defaultdict(int)
    transfers, lost = [], set()
    for i, node in enumerate(new.nodes):
        had = held.get(node.name)
        for li, layer in enumerate(new.layers):
            for e in sorted(set(layer.placement[i])):
                if had is not None and e in had[li]:
                    continue
                candidates = holders.get((li, e))
                if not candidates:
                    lost.add((li, e))
                    continue
                src = min(candidates, key=lambda s: (sends[s], s))
                sends[src] += 1
                transfers.append(Transfer(li, e, src, node.name))
    return Migration(tuple(transfers), tuple(sorted(lost)))
