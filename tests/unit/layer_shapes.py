"""Clusters for the solver's tests (their loads: ``lazarus_sim.workload.differing_loads``),
and what a re-plan's nodes held before."""
from __future__ import annotations

import numpy as np

from lazarus_core.topology import NodeSpec


def nodes(n: int, gpus: int, slots_per_gpu: int) -> list[NodeSpec]:
    return [NodeSpec(f"node-{i:02d}", gpus, slots_per_gpu, zone=f"zone-{i % 4}")
            for i in range(n)]


def held_as(*per_node, experts: int) -> np.ndarray:
    """[1 layer, node, expert]: what each node holds from before."""
    out = np.zeros((1, len(per_node), experts), dtype=bool)
    for i, es in enumerate(per_node):
        out[0, i, list(es)] = True
    return out
