"""Counts evened out below a replica per node where loads spread over many experts
(``mro._evened``): the allocation formula floors every share, and where no expert has more
replicas than there are nodes, evening out with donors keeping one per node trades nothing."""
from __future__ import annotations

from lazarus_core.allocation import allocate_many, even_out
from lazarus_core.balance import BALANCE_TARGET, busiest_rank
from lazarus_core.mro import _evened
from lazarus_core.recovery import recovery_probability
from lazarus_core.solver import plan_job
from lazarus_core.topology import NodeSpec

# 16 nodes x 2 GPUs x 4 slots (128 slots), 32 experts, zipf 0.2 and 0.25 in two orders.
NODES = [NodeSpec(f"node-{i:02d}", 2, 4) for i in range(16)]
LOADS = [[round(1 / ((e * 5 + li * 3) % 32 + 1) ** (0.2 + 0.05 * li), 6) for e in range(32)]
         for li in range(2)]
SLOTS = 128


def heaviest_over_mean(counts, loads) -> float:
    return max(t / r for t, r in zip(loads, counts)) / (sum(loads) / sum(counts))


def test_a_replica_per_node_leaves_nothing_to_trade_here():
    counts = allocate_many(LOADS, SLOTS, 2)
    assert max(max(c) for c in counts) <= len(NODES)
    per_node = even_out(counts, LOADS, len(NODES))
    assert per_node == counts  # no donor
    assert max(heaviest_over_mean(c, t) for c, t in zip(counts, LOADS)) > BALANCE_TARGET


def test_the_layers_fewest_is_the_floor_where_a_replica_per_node_trades_too_little():
    counts = allocate_many(LOADS, SLOTS, 2)
    variants = _evened(counts, LOADS, len(NODES))
    assert len(variants) == 2
    evened = variants[1]
    for before, after, loads in zip(counts, evened, LOADS):
        assert sum(after) == sum(before)
        assert min(after) >= min(before)
        assert heaviest_over_mean(after, loads) < heaviest_over_mean(before, loads)
    # The heaviest replica from 1.23 to 1.14 times the mean slot load (4 slots an expert
    # leave no finer steps); the fill mixes the rest (below).
    assert max(heaviest_over_mean(c, t) for c, t in zip(evened, LOADS)) < 1.15


def test_where_a_replica_per_node_trades_enough_there_is_one_variant():
    # 4 nodes: the hot expert holds more replicas than nodes and gives them away.
    counts = allocate_many(LOADS, SLOTS, 2)
    assert len(_evened(counts, LOADS, 4)) == 1


def test_the_plan_balances_and_recovers_as_the_formulas_counts_did():
    # Before the second variant: 1.058, with recovery 1.0 / 1.0 / 0.9964 at 1 / 2 / 3 lost.
    plan = plan_job(NODES, 32, 2, 2, "mro", LOADS, max_failures=0)
    assert busiest_rank(plan, LOADS) <= BALANCE_TARGET
    placements = [[list(s) for s in layer.placement] for layer in plan.layers]
    recovery = [recovery_probability(placements, k).probability for k in (1, 2, 3)]
    assert recovery[0] == recovery[1] == 1.0
    assert recovery[2] >= 0.9964
