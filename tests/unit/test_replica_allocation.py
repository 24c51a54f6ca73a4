import math

import pytest
from hypothesis import given, settings, strategies as st

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
])
def test_bad_input_is_a_clear_error(loads, f, match):
    with pytest.raises(ValueError, match=match):
        allocate_replicas(loads, 10, f)
