"""Migration planning: after a change, which node plays which plan position, and what moves.

The new plan's positions are interchangeable as far as recovery goes, so physical nodes can
be matched to them freely (within the same zone and slot count). We choose the matching
that keeps the most expert replicas where they already are: a linear assignment problem,
solved exactly (the paper's greedy mapping is kept as the baseline we measure against).
Within a node, each rank of the position goes to the GPU that already holds most of what
that rank needs (``map_devices``). Every replica a node still lacks becomes one transfer from
a surviving holder, with sources spread so that no holder serves more than its share; run on
the plans' per-rank views (``Plan.by_rank``), the same planning moves replicas between the
GPUs of one node too.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .anchors import LayerAnchors, anchored_replicas
from .plan import Plan, Transfer, replica_counts
from .topology import NodeSpec

Placement = list[list[int]]

# [byte value, bit]: the bits of each byte value, lowest first (``map_devices``).
_BITS = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
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
    before = (old.count_cube > 0).transpose(1, 0, 2).reshape(len(old.nodes), -1)
    before = np.where((rows >= 0)[:, None], before[np.maximum(rows, 0)], False)
    after = np.concatenate([replica_counts(p, old.experts) > 0 for p in layers], axis=1)
    return before.astype(np.int64) @ after.T.astype(np.int64)


def _compatible(nodes: Sequence[NodeSpec], positions: Sequence[NodeSpec]) -> np.ndarray:
    a, b = _shapes(nodes, positions)
    return a[:, None] == b[None, :]


def _assignment():
    """scipy's linear_sum_assignment. Imported when first needed, not at the top: it doubles
    the start-up time of every `lazarus` command, and most never re-plan."""
    from scipy.optimize import linear_sum_assignment
    return linear_sum_assignment


def preload() -> None:
    """Import now what a re-plan imports when first needed: a long-running operator calls it
    at start-up, or its first re-plan after a restart waits for scipy (0.6 s here)."""
    _assignment()


def _shapes(nodes: Sequence[NodeSpec], positions: Sequence[NodeSpec]):
    """One code per node and per position: equal codes may play each other (zone, slots,
    GPUs)."""
    codes: dict = {}
    return tuple(np.array([codes.setdefault((n.zone, n.slots, n.gpus), len(codes)) for n in side],
                          dtype=np.int64) for side in (nodes, positions))


def map_nodes_optimal(old: Plan, nodes: Sequence[NodeSpec], positions: Sequence[NodeSpec],
                      layers: Sequence[Placement]) -> list[int]:
    """position -> index into ``nodes``, keeping the most replicas in place."""
    gain = _retained(old, nodes, layers)
    cost = np.where(_compatible(nodes, positions), -gain, _FORBIDDEN)
    rows, cols = _assignment()(cost)
    mapping = [0] * len(positions)
    for r, c in zip(rows, cols):
        mapping[c] = r
    return mapping


def map_anchors(anchors: Sequence[LayerAnchors], ordered: Sequence[NodeSpec],
                references: Sequence[np.ndarray]) -> list[NodeSpec]:
    """``ordered`` with its nodes reassigned to positions so that the anchors land on the
    nodes that hold those experts already.

    A fresh structure is built on positions without regard to what nodes hold; any
    assignment of nodes of the same zone and shape to its positions recovers and balances
    exactly alike. Greedily, the (node, position) pair that keeps the most anchors first
    (``references[l][position, e]``: what the node at each position holds now). Not the
    optimal assignment: scipy's would cost the operator 38 MiB, and on the paper's setting
    the greedy one moves as little (docs/placement.md).
    """
    n, experts = len(ordered), len(anchors[0].cores)
    rows = anchored_replicas(anchors)  # (layer, position, expert)
    held_layer, held_at, held_expert = np.nonzero(np.stack(references) > 0)
    # Pair every anchor with every holder of its (layer, expert): gain[holder, position].
    anchor_key = rows[:, 0] * experts + rows[:, 2]
    held_key = held_layer * experts + held_expert
    order = np.argsort(held_key, kind="stable")
    held_key, held_at = held_key[order], held_at[order]
    first = np.searchsorted(held_key, anchor_key)
    count = np.searchsorted(held_key, anchor_key, side="right") - first
    anchor = np.repeat(np.arange(len(rows)), count)
    nth = np.arange(len(anchor)) - np.repeat(np.cumsum(count) - count, count)
    holder = held_at[first[anchor] + nth]
    gain = np.bincount(holder * n + rows[anchor, 1], minlength=n * n).reshape(n, n)
    gain[~_compatible(ordered, ordered)] = 0
    node_of = [-1] * n
    placed = [False] * n
    pairs = np.flatnonzero(gain)
    for flat in pairs[np.argsort(-gain.ravel()[pairs], kind="stable")].tolist():
        i, q = divmod(flat, n)
        if not placed[i] and node_of[q] < 0:
            node_of[q], placed[i] = i, True
    shape = _shapes(ordered, ordered)[0].tolist()
    left: dict[int, list[int]] = {}
    for i in range(n):
        if not placed[i]:
            left.setdefault(shape[i], []).append(i)
    for q in range(n):
        if node_of[q] < 0:
            node_of[q] = left[shape[q]].pop(0)
    return [ordered[i] for i in node_of]


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
    # [layer, holder, expert], from the counts the plan keeps (no pass over its slots).
    return _transfers([names[i] for i in rows], old.count_cube[:, rows] > 0, new)


def transfers_for(held: Mapping[str, Sequence[set[int]]], new: Plan) -> Migration:
    """Transfers that give every node of ``new`` the experts it lacks, from ``held``: what
    each node able to send holds, per layer (listed and sourced as ``plan_transfers``)."""
    names = list(held)
    present = np.zeros((len(new.layers), len(names), new.experts), dtype=bool)
    for i, name in enumerate(names):
        for li, experts in enumerate(held[name]):
            present[li, i, list(experts)] = True
    return _transfers(names, present, new)


def _transfers(names: Sequence[str], present: np.ndarray, new: Plan) -> Migration:
    """The transfers from holders ``names`` (``present[l, holder, e]``: holds e in layer l)
    to every node of ``new`` that lacks an expert its slots name."""
    row = {name: i for i, name in enumerate(names)}
    # Destinations' rows among the holders (-1: none; what a holder has, it does not receive).
    had_row = np.array([row.get(n.name, -1) for n in new.nodes], dtype=np.int64)
    experts, num_layers = new.experts, len(new.layers)
    # [layer, holder, expert], and a last holder for row -1: a destination holding nothing.
    held = np.zeros((num_layers, len(names) + 1, experts), dtype=bool)
    held[:, :-1] = present
    wants = (new.count_cube > 0) & ~held[:, had_row]  # [layer, destination, expert]
    # A flat index of the mask in (destination, layer, expert) order, split by hand:
    # several times faster than np.nonzero.
    flat = np.flatnonzero(wants.transpose(1, 0, 2))
    dest, at = np.divmod(flat, num_layers * experts)
    layer, expert = np.divmod(at, experts)
    # The (layer, expert) groups something is wanted of, and their holders as one flat list
    # with offsets (only theirs: most groups need nothing).
    wanted, group = np.unique(layer * experts + expert, return_inverse=True)
    holds = present[wanted // experts, :, wanted % experts]  # [wanted group, holder]
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
    sent = src >= 0
    # Names picked by numpy, tuples made by map: thousands of transfers at 1,024 GPUs.
    transfers = tuple(map(Transfer, layer[sent].tolist(), expert[sent].tolist(),
                          np.array(names, dtype=object)[src[sent]].tolist(),
                          np.array([n.name for n in new.nodes], dtype=object)[dest[sent]]
                          .tolist()))
    lost = sorted(set(zip(layer[~ok].tolist(), expert[~ok].tolist())))
    return Migration(transfers, tuple(lost))


def fill_copies(placements: np.ndarray, references: np.ndarray, slots: Sequence[int]) -> np.ndarray:
    """Per layer of a [layer, slot] fill (nodes in order, ``slots`` each): the (node,
    expert) pairs it needs that the node does not hold (``references[l][node, e]``), each
    one transfer as ``plan_transfers`` lists them, counted before there is a plan."""
    num_layers, experts = len(placements), np.asarray(references).shape[2]
    node = np.repeat(np.arange(len(slots)), slots)
    cell = (np.arange(num_layers)[:, None] * len(slots) + node[None, :]) * experts + placements
    needed = np.zeros(num_layers * len(slots) * experts, dtype=bool)
    needed[cell.ravel()] = True
    lacking = needed.reshape(num_layers, -1) & (np.asarray(references).reshape(num_layers, -1)
                                                == 0)
    return lacking.sum(axis=1)


def map_devices(old: Plan, nodes: Sequence[NodeSpec], slots: Sequence[Sequence[int]] | np.ndarray
                ) -> list[tuple[int, ...]]:
    """Which of each node's GPUs runs each rank of its plan position, in rank order: the
    assignment that keeps the most replicas on the GPU that held them under ``old``.
    ``slots``: [layer, slot], every position's slots in node order (``slots_per_gpu`` per
    rank). Nodes of one shape are weighed together: one node at a time was a tenth of a
    re-plan at 1,024 GPUs."""
    slots = np.asarray(slots, dtype=np.int64)
    out = [n.devices for n in nodes]
    starts = np.concatenate(([0], np.cumsum([n.slots for n in nodes]))).tolist()
    shapes: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for q, node in enumerate(nodes):
        if node.gpus == 1:
            continue
        try:
            i = old.node_index(node.name)
        except KeyError:
            continue  # new to the plan: it holds nothing yet
        before = old.nodes[i]
        shape = (node.gpus, node.slots_per_gpu, len(before.devices), before.slots_per_rank)
        shapes.setdefault(shape, []).append((q, i))
    for (g, s, held_gpus, held_slots), group in shapes.items():
        # [node, layer, rank or GPU, slot]: what each rank of a position needs, each GPU held.
        wanted = _columns(slots, [starts[q] for q, _ in group], g * s).reshape(
            len(group), len(old.layers), g, s)
        had = _columns(old.slot_matrix, [old.slot_offsets[i] for _, i in group],
                       held_gpus * held_slots).reshape(len(group), len(old.layers), held_gpus,
                                                       held_slots)
        # owner[node, layer * experts + e]: the GPUs that held e, one bit each.
        bits = next(t for t in (np.uint8, np.uint16, np.uint32, np.uint64)
                    if np.dtype(t).itemsize * 8 >= held_gpus)
        cells = len(old.layers) * old.experts
        base = (np.arange(len(group)) * cells)[:, None, None] + (
            np.arange(len(old.layers)) * old.experts)[None, :, None]
        owner = np.zeros(len(group) * cells, dtype=bits)
        for h in range(held_gpus):
            owner[(had[:, :, h] + base).ravel()] |= bits(1 << h)
        # [node, layer, rank, slot], C-ordered: read as bytes below (an index array from
        # the transposed ``_columns`` gives its own layout, and a wider type than a byte
        # can only be viewed so along a contiguous last axis: nodes of over 8 GPUs)
        holders = np.ascontiguousarray(owner[wanted + base[..., None]])
        # A replica a rank needs twice in a layer is kept once.
        for i in range(1, s):
            holders[..., i][(wanted[..., :i] == wanted[..., i:i + 1]).any(axis=-1)] = 0
        # kept[node, rank, GPU held]: the replicas a rank needs that the GPU holds, counted
        # by the byte values of ``holders`` per rank (a count of each value, then its bits).
        ranks = (np.arange(len(group))[:, None, None, None] * g
                 + np.arange(g)[None, None, :, None])
        ranks = np.broadcast_to(ranks, holders.shape).ravel()
        by_byte = holders.view(np.uint8).reshape(holders.size, -1)
        kept = np.concatenate(
            [np.bincount(ranks * 256 + by_byte[:, b], minlength=len(group) * g * 256)
             .reshape(-1, 256) @ _BITS for b in range(by_byte.shape[1])],
            axis=1)[:, :held_gpus].reshape(len(group), g, held_gpus)
        # Positions whose GPUs each keep more of their own rank than any other (or all of
        # it) keep their devices: the one optimum, found without an assignment.
        settled = np.zeros(len(group), dtype=bool)
        if (g, s) == (held_gpus, held_slots):
            diagonal = np.diagonal(kept, axis1=1, axis2=2)
            off = np.where(np.eye(g, dtype=bool), -1, kept).max(axis=2)
            settled = ((diagonal > off).all(axis=1) | (wanted == had).all(axis=(1, 2, 3))) & [
                nodes[q].devices == old.nodes[i].devices for q, i in group]
        for m, (q, i) in enumerate(group):
            if not settled[m]:
                out[q] = _assigned(nodes[q].devices, old.nodes[i].devices, kept[m])
    return out


def _columns(matrix: np.ndarray, starts: Sequence[int], width: int) -> np.ndarray:
    """[node, layer, slot]: ``width`` columns of ``matrix`` from each of ``starts``."""
    index = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(width)
    return matrix[:, index].transpose(1, 0, 2)


def _assigned(devices: tuple[int, ...], before: tuple[int, ...], kept: np.ndarray
              ) -> tuple[int, ...]:
    """The GPUs of ``devices`` for a position's ranks, given ``kept[rank, GPU of before]``."""
    row = {d: k for k, d in enumerate(before)}
    gain = np.zeros((len(devices), len(devices)), dtype=np.int64)
    for column, d in enumerate(devices):
        if d in row:
            gain[:, column] = kept[:, row[d]]

    ranks, columns = _assignment()(-gain)
    return tuple(devices[c] for _, c in sorted(zip(ranks, columns)))
