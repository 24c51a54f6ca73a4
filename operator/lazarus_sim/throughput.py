"""Step time under expert load imbalance: Lazarus replicas vs. standard expert parallelism.

Every MoE layer waits for its busiest rank. Lazarus: paper Algorithm 1 fills every replica
of expert e with exactly t_e / r_e tokens (up to integer rounding; design.md §4 shows why the
leftovers exactly fill the residual capacity), so the tokens rank j computes are
Σ over its slots of t_e / r_e: balanced by construction, and computable from the plan alone.
Baselines: standard expert parallelism (DeepSpeed-MoE) gives each expert the same share of
ranks, so the busiest rank computes the most popular expert's tokens. With a capacity factor
that pads every expert up to that load the compute is the same; a smaller capacity factor
would drop tokens instead, which changes the model, not the step time, and is not modelled.

Imbalance is the busiest rank's tokens over the mean per rank (1 = perfectly balanced).
"""
from __future__ import annotations

from collections.abc import Sequence

from lazarus_core.plan import Plan
from .workload import ModelSpec


def lazarus_imbalance(plan: Plan, loads: Sequence[Sequence[float]]) -> float:
    """Mean over layers of (busiest rank's expert tokens) / (mean tokens per rank)."""
    ranks = range(plan.world_size)
    total = 0.0
    for li, layer in enumerate(plan.layers):
        t = loads[li]
        per_rank = [sum(t[e] / layer.replicas[e] for e in plan.rank_experts(li, j)) for j in ranks]
        total += max(per_rank) / (sum(t) / plan.world_size)
    return total / len(plan.layers)


def expert_parallel_imbalance(loads: Sequence[Sequence[float]]) -> float:
    """Mean over layers of (most popular expert's load) / (mean expert load)."""
    return sum(max(t) / (sum(t) / len(t)) for t in loads) / len(loads)


def step_seconds(model: ModelSpec, imbalance: float) -> float:
    return model.step_s * (1 - model.expert_fraction + model.expert_fraction * imbalance)


def ratio_loads(experts: int, ratio: float) -> list[float]:
    """Loads rising geometrically from 1 to ``ratio`` (most popular : least popular)."""
    if experts == 1:
        return [1.0]
    return [ratio ** (i / (experts - 1)) for i in range(experts)]
