"""Clusters for the solver's tests (their loads: ``lazarus_sim.workload.differing_loads``)."""
from __future__ import annotations

from lazarus_core.topology import NodeSpec


def nodes(n: int, gpus: int, slots_per_gpu: int) -> list[NodeSpec]:
    return [NodeSpec(f"node-{i:02d}", gpus, slots_per_gpu, zone=f"zone-{i % 4}")
            for i in range(n)]
