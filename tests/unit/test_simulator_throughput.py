"""The throughput model's per-rank tokens agree with the runtime's Algorithm 1 counts."""
import numpy as np
import pytest

from lazarus_sim.throughput import expert_parallel_imbalance, lazarus_imbalance
from lazarus_sim.sweeps import cluster_nodes
from lazarus_core.solver import plan_job

dispatch_counts = pytest.importorskip("lazarus_runtime.dispatch_counts")


@pytest.mark.parametrize("experts,skew", [(8, 0.0), (8, 1.0), (16, 0.4), (12, 1.5)])
def test_busiest_rank_matches_algorithm_1_up_to_rounding(experts, skew):
    nodes = cluster_nodes(10, 6)
    loads = [1.0 / (e + 1) ** skew for e in range(experts)]
    plan = plan_job(nodes, experts, 1, 2, "mro", loads=[loads], max_failures=0)
    world = plan.world_size
    replicas_EW = np.zeros((experts, world), dtype=np.int64)
    for rank in range(world):
        for e in plan.rank_experts(0, rank):
            replicas_EW[e, rank] += 1
    # Tokens as the gate would route them: t_e in total, spread unevenly over senders.
    rng = np.random.default_rng(0)
    t_E = np.round(np.array(loads) / sum(loads) * 100_000).astype(np.int64)
    tokens_EW = np.stack([rng.multinomial(t, np.ones(world) / world) for t in t_E])
    counts_EWW = dispatch_counts.dispatch_counts(tokens_EW, replicas_EW)
    computed_W = counts_EWW.sum(axis=(0, 1))
    measured = computed_W.max() / (t_E.sum() / world)
    modelled = lazarus_imbalance(plan, [t_E.tolist()])
    # Rounding moves at most one token per replica slot.
    assert measured == pytest.approx(modelled, abs=6 / (t_E.sum() / world))


def test_expert_parallel_imbalance_is_hottest_over_mean():
    assert expert_parallel_imbalance([[1, 1, 1, 1]]) == 1.0
    assert expert_parallel_imbalance([[4, 2, 1, 1]]) == 2.0
