import math
from unittest import mock

import pytest
from hypothesis import given, settings, strategies as st

from lazarus_core import allocation
from lazarus_core.allocation import InfeasibleError, allocate_replicas

loads_st = st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=40)


@st.composite
def instances(draw):
    loads = draw(loads_st)
    f = draw(st.integers(1, 4))
    slots = draw(st.integers(len(loads) * f, len(loads) * f + 300))
    return loads, slots, f


@given(instances())
def test_every_slot_is_used_and_every_expert_has_its_minimum(inst):
    loads, slots, f = inst
    r = allocate_replicas(loads, slots, f)
    assert sum(r) == slots
    assert min(r) >= f


@given(instances())
def test_more_load_never_gets_fewer_replicas(inst):
    loads, slots, f = inst
    r = allocate_replicas(loads, slots, f)
    for a in range(len(loads)):
        for b in range(len(loads)):
            if loads[a] < loads[b]:
                assert r[a] <= r[b], (loads[a], loads[b], r[a], r[b])


@settings(max_examples=200)
@given(st.lists(st.floats(1, 100), min_size=2, max_size=16), st.integers(1, 2))
def test_replica_shares_track_load_shares(loads, f):
    slots = 64 * len(loads)
    r = allocate_replicas(loads, slots, f)
    total = sum(loads)
    for t, n in zip(loads, r):
        # Off by the floor at each step, plus the minimum: never more than a few slots.
        assert abs(n - t / total * slots) <= len(loads) + f


def test_floating_point_shares_do_not_lose_a_slot():
    # 0.1 + 0.2 style sums: a naive floor of each share would leave a slot unassigned.
    loads = [0.1, 0.2, 0.3, 0.1 + 0.2, 0.7, 1 / 3]
    for slots in range(12, 200):
        assert sum(allocate_replicas(loads, slots, 2)) == slots


def test_equal_loads_split_evenly():
    assert sorted(allocate_replicas([5.0] * 4, 10, 1)) == [2, 2, 3, 3]


def test_zero_traffic_counts_as_equal_loads():
    assert allocate_replicas([0, 0, 0], 9, 1) == [3, 3, 3]


def test_infeasible_threshold_names_the_problem():
    with pytest.raises(InfeasibleError, match="16 experts x 2 replicas = 32"):
        allocate_replicas([1.0] * 16, 30, 2)


@pytest.mark.parametrize("loads,f,match", [
    ([], 1, "experts"), ([1.0], 0, "min_replicas"), ([1.0, -1.0], 1, "loads"),
    ([math.nan, 1.0], 1, "loads"),
    # Each finite, but their sum is not: every share would be 0 or NaN.
    ([1e308, 1e308, 1.0], 1, "layer 0's loads sum past the largest float"),
    ([10**400, 1], 1, "finite number"),  # a token count no float holds
])
def test_bad_input_is_a_clear_error(loads, f, match):
    with pytest.raises(ValueError, match=match):
        allocate_replicas(loads, 10, f)


def test_loads_too_small_or_too_large_for_the_arithmetic_are_scaled_and_others_kept():
    # A replica's share of 5e-324 rounds to 0: evening out such a layer ended in a numpy
    # error. Shares do not change with scale, so such layers are scaled to a largest of 1.
    t = allocation.measured_loads([[0.0, 5e-324], [2.0 ** 600, 2.0 ** 601], [3.0, 1e-300]])
    assert t.tolist() == [[0.0, 1.0], [0.5, 1.0], [3.0, 1e-300]]
    assert allocation.allocate_many([[0.0, 5e-324]], 8, 1) == allocation.allocate_many(
        [[0.0, 1.0]], 8, 1)


def _even_out_step_by_step(replicas, loads, keep):
    """even_out's docstring, one trade at a time: from the expert whose replicas would
    still carry the least after giving one (ties: less load, then id) to the one whose
    replicas carry the most (ties: more load, then id), while that lowers the most."""
    r = list(replicas)
    if sum(loads) <= 0:
        return r
    while True:
        x = min((e for e in range(len(r)) if r[e]), key=lambda e: (-loads[e] / r[e], -loads[e], e))
        donors = [e for e in range(len(r)) if r[e] > keep]
        if not donors:
            return r
        d = min(donors, key=lambda e: (loads[e] / (r[e] - 1), loads[e], e))
        if d == x or loads[d] / (r[d] - 1) >= loads[x] / r[x]:
            return r
        r[x] += 1
        r[d] -= 1


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_evening_out_is_the_step_by_step_trade(data):
    from lazarus_core.allocation import allocate_many, even_out
    experts = data.draw(st.integers(1, 24))
    nodes = data.draw(st.integers(1, 12))
    f = data.draw(st.integers(1, 3))
    slots = data.draw(st.integers(experts * f, experts * f + 400))
    # Loads with ties (equal loads, loads in simple ratios) as well as random ones; layers
    # evened out together, each with its own floor for donors.
    layers = data.draw(st.lists(
        st.lists(st.one_of(st.sampled_from([0.0, 1.0, 0.5, 0.25, 1 / 3]), st.floats(0, 10)),
                 min_size=experts, max_size=experts), min_size=1, max_size=3))
    layers = allocation.measured_loads(layers).tolist()  # as the solver passes them
    replicas = allocate_many(layers, slots, f)
    keep = data.draw(st.one_of(st.sampled_from([nodes, 1, f]),
                               st.lists(st.integers(1, 12), min_size=len(layers),
                                        max_size=len(layers))))
    # Small layers rarely list enough donor levels for the lower cut: half the examples
    # take it on every layer.
    with mock.patch.object(allocation, "MANY_LEVELS",
                           0 if data.draw(st.booleans()) else allocation.MANY_LEVELS):
        got = even_out(replicas, layers, keep)
    each = [keep] * len(layers) if isinstance(keep, int) else keep
    assert got == [_even_out_step_by_step(r, t, k) for r, t, k in zip(replicas, layers, each)]
    assert [sum(r) for r in got] == [sum(r) for r in replicas]


def test_evening_out_widens_its_windows_where_one_expert_trades_many_times():
    # One hot expert gives 200 replicas away and the cold ones gain up to 9 each: more
    # than the first windows hold (2 levels a receiver, 64 a donor).
    from lazarus_core.allocation import even_out
    loads = [1000.0] + [40.0 + e for e in range(24)]
    replicas = [300] + [1] * 24
    got = even_out([replicas], [loads], 1)[0]
    assert got == _even_out_step_by_step(replicas, loads, 1)
    assert replicas[0] - got[0] > 64 and max(got[1:]) - 1 > 2


def test_evening_out_below_a_lower_cut_is_the_step_by_step_trade():
    # Donors keeping the layer's fewest list about 750 levels under the highest receiver
    # level here (1,024 GPUs' slots, 256 experts): the first pass lists those under a
    # lower receiver level, and its trades are still the step-by-step ones.
    from lazarus_sim.workload import differing_loads
    loads = differing_loads(256, 4, 0.7, 7)
    replicas = allocation.allocate_many(loads, 4096, 2)
    keep = [min(r) for r in replicas]
    with mock.patch.object(allocation, "_cutoff", wraps=allocation._cutoff) as cut:
        got = allocation.even_out(replicas, loads, keep)
    assert cut.called
    assert got == [_even_out_step_by_step(r, t, k) for r, t, k in zip(replicas, loads, keep)]
