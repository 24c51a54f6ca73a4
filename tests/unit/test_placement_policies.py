from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st

from lazarus_core.allocation import allocate_replicas
from lazarus_core.placement import compact, spread
from lazarus_core.recovery import recovery_probability
from lazarus_core.solver import place, plan_job, replan
from lazarus_core.topology import NodeSpec


def _check_valid(placement, replicas, slots):
    assert [len(p) for p in placement] == list(slots)
    counts = Counter(e for p in placement for e in p)
    assert [counts[e] for e in range(len(replicas))] == list(replicas)


@st.composite
def configs(draw):
    n = draw(st.integers(2, 12))
    c = draw(st.integers(1, 8))
    f = draw(st.integers(1, 3))
    f = min(f, n * c)
    e = draw(st.integers(1, n * c // f))
    skew = draw(st.sampled_from([0.0, 0.5, 1.0, 2.0]))
    layers = draw(st.integers(1, 3))
    loads = [[1 / (i + 1) ** (skew * (l + 1)) for i in range(e)] for l in range(layers)]
    return n, c, f, loads


@settings(max_examples=60, deadline=None)
@given(configs())
def test_every_policy_respects_slots_and_replica_counts(cfg):
    n, c, f, loads = cfg
    replicas = [allocate_replicas(l, n * c, f) for l in loads]
    for policy in ("mro", "spread", "compact"):
        for placement, r in zip(place(policy, replicas, [c] * n), replicas):
            _check_valid(placement, r, [c] * n)


@given(st.integers(2, 10), st.integers(1, 6), st.integers(1, 12))
def test_spread_puts_replicas_of_an_expert_on_distinct_nodes(n, c, e):
    if e > n * c:
        return
    replicas = allocate_replicas([1.0] * e, n * c, 1)
    placement = spread(replicas, [c] * n)
    for expert, r in enumerate(replicas):
        assert sum(expert in p for p in placement) == min(r, n)


def test_compact_fills_node_by_node():
    assert compact([3, 1], [2, 2]) == [[0, 0], [0, 1]]


def test_mro_nests_experts_on_a_prefix_when_they_fit_one_node():
    placement = place("mro", [[2, 3, 7]], [3] * 4)[0]
    holders = [{i for i, p in enumerate(placement) if e in p} for e in range(3)]
    assert holders[0] == {0, 1} and holders[1] == {0, 1, 2} and holders[2] == {0, 1, 2, 3}


def test_mro_handles_experts_with_more_replicas_than_nodes_in_their_group():
    replicas = [[2, 2, 2, 2, 2, 2, 2, 2, 4, 16]]  # E=10 > c=3, one expert far above N/G
    placement = place("mro", replicas, [3] * 12)[0]
    _check_valid(placement, replicas[0], [3] * 12)
    for e, r in enumerate(replicas[0]):  # duplicates only once an expert has its own nodes
        assert sum(e in p for p in placement) >= min(r, 2)


SWEEP = [(n, c, e, f, s) for n in (4, 6, 8, 10, 12) for c in (2, 4, 6) for e in (2, 4, 8, 12, 16)
         for f in (1, 2) for s in (0.0, 0.5, 1.0, 1.5) if e * f <= n * c]


@pytest.mark.parametrize("n,c,e,f,s", SWEEP)
def test_mro_is_at_least_as_good_as_spread_and_compact_at_every_k(n, c, e, f, s):
    nodes = [NodeSpec(f"n{i}", 1, c) for i in range(n)]
    loads = [[1 / (i + 1) ** s for i in range(e)]] * 2
    plans = {p: plan_job(nodes, e, 2, f, p, loads=loads, max_failures=min(n, 6))
             for p in ("mro", "spread", "compact")}
    for k, ours in plans["mro"].recovery.items():
        assert ours >= plans["spread"].recovery[k] - 1e-9, (k, plans["spread"].recovery)
        assert ours >= plans["compact"].recovery[k] - 1e-9, (k, plans["compact"].recovery)


def test_layers_are_aligned_so_the_model_fails_like_one_layer():
    nodes = [NodeSpec(f"n{i}", 1, 6) for i in range(10)]
    loads = [[1 / (i + 1) ** s for i in range(6)] for s in (0.0, 0.7, 1.4)]
    plan = plan_job(nodes, 6, 3, 2, "mro", loads=loads)
    layers = [[list(s) for s in l.placement] for l in plan.layers]
    for k in range(1, 6):
        model = recovery_probability(layers, k).probability
        worst_layer = min(recovery_probability([l], k).probability for l in layers)
        assert model == pytest.approx(worst_layer)


def test_every_expert_survives_losing_any_one_zone():
    from lazarus_core.recovery import cube_presence, zone_survival
    nodes = [NodeSpec(f"n{i}", 1, 4, zone=f"z{i % 3}") for i in range(9)]
    for policy in ("mro", "spread"):
        for e in (4, 8, 16):
            plan = plan_job(nodes, e, 2, 2, policy, loads=[[1 / (i + 1) for i in range(e)]] * 2)
            survival = zone_survival(cube_presence(plan.count_cube), [n.zone for n in plan.nodes])
            assert all(survival.values()), (policy, e)


def test_on_demand_nodes_hold_the_core_every_expert_relies_on():
    nodes = [NodeSpec(f"spot{i}", 1, 4, capacity_type="spot") for i in range(6)]
    nodes += [NodeSpec(f"od{i}", 1, 4) for i in range(2)]
    plan = plan_job(nodes, 4, 1, 2, "mro")
    assert [n.name for n in plan.nodes[:2]] == ["od0", "od1"]


@st.composite
def mixed_clusters(draw):
    n = draw(st.integers(2, 14))
    nodes = [NodeSpec(f"n{i}", draw(st.integers(1, 4)), draw(st.integers(1, 4)),
                      zone=f"z{draw(st.integers(0, 2))}",
                      capacity_type=draw(st.sampled_from(["spot", "on-demand"])))
             for i in range(n)]
    slots = sum(x.slots for x in nodes)
    experts = draw(st.integers(1, max(1, slots // 2)))
    layers = draw(st.integers(1, 3))
    loads = draw(st.none() | st.just([[1 / (e + 1 + li) for e in range(experts)]
                                      for li in range(layers)]))
    lost = draw(st.sets(st.sampled_from([x.name for x in nodes]), max_size=n - 1))
    return nodes, experts, layers, loads, lost


@settings(max_examples=40, deadline=None)
@given(mixed_clusters())
def test_mro_plans_and_replans_nodes_of_every_size(case):
    # Nodes with different GPU and slot counts, zones and capacity types: every plan and
    # re-plan validates (slots filled, replica counts, ranks), and a re-plan keeps a
    # node's experts only where the node still exists.
    nodes, experts, layers, loads, lost = case
    plan = plan_job(nodes, experts, layers, 1, "mro", loads=loads, max_failures=2)
    survivors = [x for x in nodes if x.name not in lost]
    if sum(x.slots for x in survivors) < experts:
        return
    result = replan(plan, survivors, "NodeLost", {x.name for x in survivors}, loads,
                    max_failures=2)
    assert {x.name for x in result.plan.nodes} == {x.name for x in survivors}
    assert all(t.source not in lost for t in result.migration.transfers)
