import math
from itertools import combinations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from lazarus_core import recovery
from lazarus_core.recovery import (masks_of, minimal_sets, presence, recovery_probability,
                                   zone_survival)


def _brute_force(layers, k):
    n = len(layers[0])
    alive = 0
    for failed in combinations(range(n), k):
        ok = all(any(i not in failed for i, p in enumerate(layer) if e in p)
                 for layer in layers for e in {e for p in layer for e in p})
        alive += ok
    return alive / math.comb(n, k)


placements = st.integers(2, 7).flatmap(lambda n: st.lists(
    st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=3), min_size=n, max_size=n),
    min_size=1, max_size=2))


@settings(max_examples=150, deadline=None)
@given(placements, st.integers(0, 7))
def test_exact_recovery_matches_brute_force(layers, k):
    k = min(k, len(layers[0]))
    got = recovery_probability(layers, k)
    assert got.exact
    assert got.probability == pytest.approx(_brute_force(layers, k))


def test_enumeration_fallback_matches_inclusion_exclusion(monkeypatch):
    layers = [[[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3], [0, 1], [2, 3]]]
    exact = recovery_probability(layers, 4).probability
    monkeypatch.setattr(recovery, "_INCLUSION_EXCLUSION_BUDGET", 0)
    assert recovery_probability(layers, 4).probability == pytest.approx(exact)


def test_monte_carlo_states_a_confidence_interval_that_holds(monkeypatch):
    layers = [[[e % 7, (e * 3) % 7] for e in range(14)]]
    exact = recovery_probability(layers, 3).probability
    monkeypatch.setattr(recovery, "_INCLUSION_EXCLUSION_BUDGET", 0)
    monkeypatch.setattr(recovery, "_ENUMERATION_LIMIT", 0)
    estimate = recovery_probability(layers, 3)
    assert not estimate.exact and 0 < estimate.half_width < 0.02
    assert abs(estimate.probability - exact) <= estimate.half_width


def test_large_clusters_stay_exact_under_mro_structure():
    # 128 nodes, k = 5: C(128, 5) = 2.6e8 failed sets, but few minimal sets.
    # Experts 0-1 nest on nodes {0, 1}, experts 2-3 on {2, 3}; the rest only add width.
    layers = [[[0, 1] if i < 2 else [2, 3] if i < 4 else [4, 5] for i in range(128)]]
    got = recovery_probability(layers, 5)
    assert got.exact
    fail = 2 * math.comb(126, 3) - math.comb(124, 1)  # either pair, minus both
    assert got.probability == pytest.approx(1 - fail / math.comb(128, 5))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 200).flatmap(lambda n: st.lists(
    st.lists(st.booleans(), min_size=n, max_size=n), min_size=1, max_size=6)))
def test_masks_have_one_bit_per_node_at_any_width(rows):
    # Widths around 64 cross the 64-bit words the masks are joined from.
    present = np.array(rows, dtype=bool).reshape(len(rows), -1)
    assert masks_of(present) == [sum(1 << i for i, held in enumerate(r) if held) for r in rows]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 200).flatmap(lambda n: st.tuples(st.just(n), st.lists(
    st.lists(st.booleans(), min_size=n, max_size=n), max_size=8))))
def test_minimal_rows_are_the_minimal_sets_at_any_width(case):
    # Rows are told apart by sorting 64-bit words of them: widths around 64, repeated rows,
    # and no rows or no columns at all.
    n, rows = case
    present = np.array(rows + rows[:2], dtype=bool).reshape(len(rows) + len(rows[:2]), n)
    got = recovery.minimal_rows(present)
    assert sorted(masks_of(got)) == sorted(minimal_sets(m for m in masks_of(present) if m))
    assert list(got.sum(axis=1)) == sorted(got.sum(axis=1))


def test_only_minimal_sets_are_kept():
    assert minimal_sets([0b011, 0b111, 0b100, 0b110]) == [0b100, 0b011]


def test_zone_loss_is_fatal_only_when_an_expert_lives_in_one_zone():
    layer = [[0, 0], [1, 1], [0, 0], [1, 1]]  # expert 0 on nodes {0, 2}, expert 1 on {1, 3}
    assert zone_survival(presence([layer]), ["a", "b", "b", "a"]) == {"a": True, "b": True}
    assert zone_survival(presence([layer]), ["a", "b", "a", "b"]) == {"a": False, "b": False}
    assert zone_survival(presence([layer]), ["a", "b", "a", "c"]) == {"a": False, "b": True,
                                                                       "c": True}


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_fatal_counts_beyond_the_bitmap_match_enumeration(data):
    # Past BITMAP_NODES the counts come from one inclusion-exclusion pass for every k (or
    # one per k when that pass is over budget), cached by node sets: each must equal
    # counting the fatal failure sets one by one, in whatever order the sets come.
    n = data.draw(st.integers(recovery.BITMAP_NODES + 1, 16))
    node_sets = data.draw(st.lists(st.sets(st.integers(0, n - 1), min_size=1, max_size=4),
                                   min_size=1, max_size=12))
    masks = [sum(1 << i for i in s) for s in node_sets]
    expected = [sum(any(m & f == m for m in masks)
                    for f in (sum(1 << i for i in c) for c in combinations(range(n), k)))
                for k in range(1, 5)]
    assert recovery.fatal_counts(masks, n, 4) == expected
    assert recovery.fatal_counts(list(reversed(masks)), n, 4) == expected
    # A budget too small for every k at once still counts the k that fit alone, exactly.
    short = recovery.fatal_counts(masks, n, 4, budget=len(masks) * 3)
    assert short == expected[:len(short)]


def test_a_plans_count_cube_gives_the_presence_of_its_placements():
    # Plans score recovery and zones from their count cube, not their nested slots: the two
    # must name the same node sets, expert by expert and layer by layer, uneven nodes too.
    from lazarus_core.recovery import cube_presence
    from lazarus_core.solver import plan_job
    from lazarus_core.topology import NodeSpec
    nodes = [NodeSpec(f"n{i}", 1 + i % 2, 3) for i in range(7)]
    plan = plan_job(nodes, 9, 3, 2, "mro", loads=[[1 / (e + l + 1) for e in range(9)]
                                                   for l in range(3)], max_failures=4)
    layers = [[list(s) for s in layer.placement] for layer in plan.layers]
    assert (cube_presence(plan.count_cube) == presence(layers)).all()
    assert plan.recovery == {str(k): recovery_probability(layers, k).probability
                             for k in range(1, 5)}
