"""The failure domains a plan is made for: nodes, their zones, GPUs and expert slots."""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeSpec:
    """A machine that can run workers: one worker rank per GPU, ``slots_per_gpu`` experts each."""

    name: str
    gpus: int = 1
    slots_per_gpu: int = 1
    zone: str = ""
    # "spot" or "on-demand": on-demand nodes are placed where losing them would hurt most.
    capacity_type: str = "on-demand"
    # Which of the node's GPUs (local ranks) are usable, ``gpus`` of them: 0..gpus-1 until
    # one fails and its rank with it.
    devices: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.devices:
            object.__setattr__(self, "devices", tuple(range(self.gpus)))

    @property
    def slots(self) -> int:
        return self.gpus * self.slots_per_gpu

    def without_gpus(self, lost: set[int]) -> "NodeSpec":
        """The node after the GPUs ``lost`` failed (at least one must remain)."""
        devices = tuple(d for d in self.devices if d not in lost)
        return dataclasses.replace(self, gpus=len(devices), devices=devices)


def check_nodes(nodes: list[NodeSpec]) -> None:
    if not nodes:
        raise ValueError("nodes: need at least one node")
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise ValueError("nodes: node names must be unique")
    for n in nodes:
        if n.gpus < 1:
            raise ValueError(f"nodes[{n.name}].gpus: must be >= 1, got {n.gpus}")
        if n.slots_per_gpu < 1:
            raise ValueError(f"nodes[{n.name}].slots_per_gpu: must be >= 1, got {n.slots_per_gpu}")
        if len(n.devices) != n.gpus or len(set(n.devices)) != n.gpus:
            raise ValueError(f"nodes[{n.name}].devices: needs {n.gpus} distinct GPU indices, "
                             f"got {list(n.devices)}")


def failure_domain_order(nodes: list[NodeSpec]) -> list[NodeSpec]:
    """Nodes in the order placement fills them: zones interleaved, on-demand first.

    MRO nests every expert's replicas on a prefix of this order, so a prefix must never sit
    inside one zone (a zone outage would then take an expert whole), and the nodes that
    every expert relies on should be the ones least likely to be reclaimed.
    """
    by_zone: dict[str, list[NodeSpec]] = defaultdict(list)
    for n in sorted(nodes, key=lambda n: (n.capacity_type == "spot", n.name)):
        by_zone[n.zone].append(n)
    # Largest zones first so that the tail of the order is as mixed as the counts allow.
    queues = sorted(by_zone.values(), key=lambda q: (-len(q), q[0].zone))
    order = []
    while any(queues):
        for q in queues:
            if q:
                order.append(q.pop(0))
    return order


def zones_of(nodes: list[NodeSpec]) -> dict[str, list[int]]:
    """Node positions per zone."""
    zones: dict[str, list[int]] = defaultdict(list)
    for i, n in enumerate(nodes):
        zones[n.zone].append(i)
    return dict(zones)
