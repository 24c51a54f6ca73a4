"""Clusters and loads for the solver's tests: layers that differ in shape, not only in which
expert is hot."""
from __future__ import annotations

import numpy as np

from lazarus_core.topology import NodeSpec


def differing_loads(experts: int, layers: int, skew: float, seed: int) -> list[list[float]]:
    """Per layer a zipf exponent within 0.3 of ``skew``, lognormal(0, 0.2) noise per expert
    and a random order (rounded, so that the loads do not depend on float printing)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(layers):
        exponent = max(skew + rng.uniform(-0.3, 0.3), 0.0)
        t = rng.lognormal(0, 0.2, experts) / np.arange(1, experts + 1) ** exponent
        out.append([round(float(x), 9) for x in rng.permutation(t)])
    return out


def nodes(n: int, gpus: int, slots_per_gpu: int) -> list[NodeSpec]:
    return [NodeSpec(f"node-{i:02d}", gpus, slots_per_gpu, zone=f"zone-{i % 4}")
            for i in range(n)]
