"""Sweeps without a trace: recovery probability vs failed nodes, throughput vs load skew."""
from __future__ import annotations

from collections.abc import Sequence

from lazarus_core.plan import POLICIES
from lazarus_core.recovery import recovery_probability
from lazarus_core.solver import plan_job
from lazarus_core.topology import NodeSpec
from .throughput import expert_parallel_imbalance, lazarus_imbalance, ratio_loads, step_seconds
from .workload import ModelSpec


def cluster_nodes(nodes: int, slots_per_gpu: int, gpus_per_node: int = 1) -> list[NodeSpec]:
    return [NodeSpec(f"node-{i}", gpus_per_node, slots_per_gpu) for i in range(nodes)]


def recovery_curves(model: ModelSpec, nodes: list[NodeSpec], min_replicas: int,
                    loads: Sequence[Sequence[float]], max_failures: int
                    ) -> dict[str, list[float]]:
    """policy -> model-level recovery probability for k = 1..max_failures failed nodes."""
    curves = {}
    for policy in POLICIES:
        plan = plan_job(nodes, model.experts, model.layers, min_replicas, policy, loads=loads,
                        max_failures=0)
        layers = [[list(s) for s in layer.placement] for layer in plan.layers]
        curves[policy] = [recovery_probability(layers, k).probability
                          for k in range(1, max_failures + 1)]
    return curves


def throughput_vs_skew(model: ModelSpec, nodes: list[NodeSpec], min_replicas: int,
                       ratios: Sequence[float]) -> dict[str, list[float]]:
    """Samples per second with no failures as the hottest:coldest expert load ratio grows.

    Keys: "Lazarus" (MRO plan for those loads) and "DeepSpeed" (standard expert parallelism).
    """
    world = sum(n.gpus for n in nodes)
    per_step = world * model.batch_per_gpu
    out: dict[str, list[float]] = {"Lazarus": [], "DeepSpeed": []}
    for r in ratios:
        loads = [ratio_loads(model.experts, r)] * model.layers
        plan = plan_job(nodes, model.experts, model.layers, min_replicas, "mro", loads=loads,
                        max_failures=0)
        out["Lazarus"].append(per_step / step_seconds(model, lazarus_imbalance(plan, loads)))
        out["DeepSpeed"].append(
            per_step / step_seconds(model, expert_parallel_imbalance(loads)))
    return out
