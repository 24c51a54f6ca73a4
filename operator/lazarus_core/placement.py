"""Placement policies: which node slots hold the replicas of each expert.

A placement of one layer is a list, per node position, of the expert ids in its slots.
Positions follow ``topology.failure_domain_order``. All policies take the replica counts
of every layer at once because MRO aligns layers (the model survives only if every layer
does).
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

Placement = list[list[int]]  # node position -> expert ids, one per slot



def _check(replicas: Sequence[int], slots: Sequence[int]) -> None:
    if sum(replicas) != sum(slots):
        raise ValueError(f"replicas: {sum(replicas)} replicas for {sum(slots)} slots")


def compact(replicas: Sequence[int], slots: Sequence[int]) -> Placement:
    """Fill node by node, expert by expert: the baseline that keeps an expert together."""
    _check(replicas, slots)
    flat = [e for e, r in enumerate(replicas) for _ in range(r)]
    placement, start = [], 0
    for s in slots:
        placement.append(flat[start:start + s])
        start += s
    return placement


def spread(replicas: Sequence[int], slots: Sequence[int]) -> Placement:
    """Deal replicas round-robin over nodes, so an expert's replicas land on distinct nodes."""
    _check(replicas, slots)
    placement: Placement = [[] for _ in slots]
    node = 0
    for e, r in enumerate(replicas):
        for _ in range(r):
            while len(placement[node]) == slots[node]:
                node = (node + 1) % len(slots)
            placement[node].append(e)
            node = (node + 1) % len(slots)
    return placement


@dataclass(frozen=True)
class Grouping:
    """Experts cut into popularity groups, each with its own range of node positions."""

    group_of: tuple[int, ...]
    ranges: tuple[tuple[int, ...], ...]
    nested: int  # groups [0, nested) are nested; the rest share their ranges round-robin

    @classmethod
    def build(cls, layers: Sequence[Sequence[int]], slots: Sequence[int],
              group_sizes: Sequence[int], nested: int | None = None) -> "Grouping":
        """One grouping for every layer, so the layers' failure sets coincide."""
        group_of = _popularity_groups(layers, group_sizes)
        ranges = _node_ranges(layers, slots, group_of, len(group_sizes))
        return cls(tuple(group_of), tuple(tuple(r) for r in ranges),
                   len(group_sizes) if nested is None else nested)


def nested_groups(replicas: Sequence[int], slots: Sequence[int], grouping: Grouping) -> Placement:
    """MRO's construction for one layer: each popularity group nested on its node range.

    Within a group, the least popular expert sits on the first r nodes of the range and
    every more popular one on a longer prefix, so the group fails only when its smallest
    node set fails. Groups past ``grouping.nested`` share their ranges round-robin, which
    is better when a range is too short for the replicas it would have to nest. Replicas
    that do not fit go where they add a new node to the expert, else anywhere free.
    """
    _check(replicas, slots)
    ranges, group_of = grouping.ranges, grouping.group_of
    shared = [node for r in ranges[grouping.nested:] for node in r]
    placement: Placement = [[] for _ in slots]
    left = list(replicas)
    cursor = 0
    for e in sorted(range(len(replicas)), key=lambda e: (replicas[e], e)):
        if group_of[e] < grouping.nested:
            targets = ranges[group_of[e]][:replicas[e]]
        else:  # deal round-robin over the shared ranges, like spread
            targets = [shared[(cursor + i) % len(shared)]
                       for i in range(min(replicas[e], len(shared)))]
            cursor += len(targets)
        for node in targets:
            if len(placement[node]) < slots[node]:
                placement[node].append(e)
                left[e] -= 1
    _place_leftovers(placement, slots, left, grouping)
    return placement


def _popularity_groups(layers: Sequence[Sequence[int]], group_sizes: Sequence[int]) -> list[int]:
    """Group id per expert: consecutive runs of the model-wide popularity order."""
    num_experts = len(layers[0])
    assert sum(group_sizes) == num_experts
    total = [sum(layer[e] for layer in layers) for e in range(num_experts)]
    order = sorted(range(num_experts), key=lambda e: (total[e], e))
    group_of = [0] * num_experts
    start = 0
    for g, size in enumerate(group_sizes):
        for e in order[start:start + size]:
            group_of[e] = g
        start += size
    return group_of


def _node_ranges(layers, slots, group_of, num_groups) -> list[list[int]]:
    """Consecutive node positions per group, sized by the group's share of replicas."""
    mass = [0] * num_groups
    for layer in layers:
        for e, r in enumerate(layer):
            mass[group_of[e]] += r
    n = len(slots)
    sizes = _apportion(mass, n)
    ranges, start = [], 0
    for size in sizes:
        ranges.append(list(range(start, start + size)))
        start += size
    return ranges


def _apportion(weights: Sequence[int], total: int) -> list[int]:
    """Split ``total`` into integer parts proportional to ``weights``, each at least 1."""
    w = sum(weights) or 1
    quotas = [total * x / w for x in weights]
    parts = [max(1, int(q)) for q in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda i: (parts[i] - quotas[i], i))
    i = 0
    while sum(parts) < total:
        parts[by_remainder[i % len(parts)]] += 1
        i += 1
    while sum(parts) > total:
        j = max((i for i in range(len(parts)) if parts[i] > 1),
                key=lambda i: (parts[i] - quotas[i], parts[i]))
        parts[j] -= 1
    return parts


def _place_leftovers(placement: Placement, slots, left, grouping: Grouping) -> None:
    """Put each replica that did not fit its range where it widens its expert's node set."""
    free = [s - len(p) for s, p in zip(slots, placement)]
    n = len(slots)
    for e in sorted((e for e in range(len(left)) if left[e]), key=lambda e: -left[e]):
        home = grouping.ranges[grouping.group_of[e]]
        # Prefer extending the nesting: the nodes after the expert's range, in order.
        for i in [*range(home[-1] + 1, n), *range(0, home[0])]:
            if not left[e]:
                break
            if free[i] and e not in placement[i]:
                placement[i].append(e)
                free[i] -= 1
                left[e] -= 1
        if left[e]:  # every reachable node holds it: duplicates where room is widest
            roomiest = [(-free[i], i) for i in range(n) if free[i]]
            heapq.heapify(roomiest)
            while left[e]:
                neg_free, i = heapq.heappop(roomiest)
                placement[i].append(e)
                free[i] -= 1
                left[e] -= 1
                if free[i]:
                    heapq.heappush(roomiest, (neg_free + 1, i))
    assert not any(free), "every slot must be filled when replicas == slots"
