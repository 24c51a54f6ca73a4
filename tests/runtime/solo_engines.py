"""An engine that trains a whole job on one rank: the reference the distributed runs equal."""
from __future__ import annotations

from lazarus_core.runtime_config import RuntimeConfig
from lazarus_core.solver import plan_job
from lazarus_core.topology import NodeSpec
from lazarus_runtime.collectives import Collectives
from lazarus_runtime.engine import Engine


def solo_engine(runtime: dict) -> Engine:
    """An engine for ``spec.runtime`` holding every expert, at world size 1."""
    cfg = RuntimeConfig.from_manifest(runtime)
    E, L = cfg.model.experts, cfg.model.layers
    plan = plan_job([NodeSpec("solo", gpus=1, slots_per_gpu=E)], experts=E, layers=L,
                    min_replicas=1)
    return Engine(cfg, plan, 0, Collectives.single())
