"""Placement policies: which node slots hold the replicas of each expert.

A placement of one layer is a list, per node position, of the expert ids in its slots.
Positions follow ``topology.failure_domain_order``. All policies take the replica counts
of every layer at once because MRO aligns layers (the model survives only if every layer
does).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Placement = list[list[int]]  # node position -> expert ids, one per slot

POLICIES = ("mro", "spread", "compact")


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


def nested_groups(replicas: Sequence[int], slots: Sequence[int], grouping: Grouping,
                  loads: Sequence[float] | None = None) -> Placement:
    """MRO's construction for one layer: each popularity group nested on its node range.

    Every expert of a nested group has a replica on each node of the group's *core*: the
    first m nodes of its range, m being the fewest replicas any of the group's experts has.
    The group's coldest expert lives on the core alone, and every other one contains it, so
    the group is lost exactly when its core is: where the other replicas go does not change
    recovery. They go where they even out the load per node instead (``loads``: the
    layer's expert loads). Groups past ``grouping.nested`` share their ranges round-robin,
    which is better when a range is too short for the replicas it would have to nest.
    """
    _check(replicas, slots)
    ranges, group_of = grouping.ranges, grouping.group_of
    shared = [node for r in ranges[grouping.nested:] for node in r]
    core = [min(min((replicas[e] for e in range(len(replicas)) if group_of[e] == g),
                    default=0), len(r))
            for g, r in enumerate(ranges[:grouping.nested])]
    placement: Placement = [[] for _ in slots]
    left = list(replicas)
    cursor = 0
    for e in sorted(range(len(replicas)), key=lambda e: (replicas[e], e)):
        if group_of[e] < grouping.nested:
            targets = ranges[group_of[e]][:core[group_of[e]]]
        else:  # deal round-robin over the shared ranges, like spread
            targets = [shared[(cursor + i) % len(shared)]
                       for i in range(min(replicas[e], len(shared)))]
            cursor += len(targets)
        for node in targets:
            if len(placement[node]) < slots[node]:
                placement[node].append(e)
                left[e] -= 1
    load = loads if loads is not None else [1.0] * len(replicas)
    _fill_balanced(placement, slots, left, [t / r for t, r in zip(load, replicas)])
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


def _fill_balanced(placement: Placement, slots, left, weight) -> None:
    """Place the remaining replicas to even out per-node load (Algorithm 1 gives each
    replica of expert e the same share, ``weight[e]``): heaviest first, in rounds that give
    every node with room one replica, least loaded node first. A node gets a replica of an
    expert it already holds only if none of the next few candidates fits better."""
    load = [sum(weight[e] for e in p) for p in placement]
    held = [set(p) for p in placement]
    items = sorted((e for e in range(len(left)) for _ in range(left[e])),
                   key=lambda e: (-weight[e], e))
    i = 0
    while i < len(items):
        open_nodes = sorted((n for n in range(len(slots)) if len(placement[n]) < slots[n]),
                            key=lambda n: (load[n], n))
        assert open_nodes, "every slot must be filled when replicas == slots"
        for n in open_nodes:
            if i == len(items):
                break
            j = next((j for j in range(i, min(i + 8, len(items))) if items[j] not in held[n]),
                     i)
            items[i], items[j] = items[j], items[i]
            e = items[i]
            placement[n].append(e)
            held[n].add(e)
            load[n] += weight[e]
            i += 1
