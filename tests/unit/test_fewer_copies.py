"""A small re-plan's placement is annealed toward the nodes that hold its replicas, with no
layer's busiest rank busier, no new fatal set and the same counts (fewer_copies.py)."""
from __future__ import annotations

import numpy as np
import pytest

from lazarus_core import fewer_copies
from lazarus_core.balance import busiest_rank, layer_balance
from lazarus_core.fewer_copies import with_fewer_copies
from lazarus_core.recovery import cube_presence, fatal_counts, minimal_masks
from lazarus_core.solver import plan_job, replan
from lazarus_sim.workload import differing_loads

from layer_shapes import held_as, nodes


def copies(row, held, slots):
    node_of = np.repeat(np.arange(held.shape[1]), slots)
    return len({(int(n), int(e)) for n, e in zip(node_of, row) if not held[0, n, e]})


def test_a_cold_expert_returns_to_the_pair_that_holds_it():
    # Experts 0 and 1 have one replica on each node of a pair; the fill put 0 on nodes
    # 0-1, which hold 1, and 1 on nodes 2-3, which hold 0. Expert 2 is on every node.
    # No single swap keeps both pairs whole; moving each expert to the other's pair
    # copies nothing.
    held = held_as({1, 2}, {1, 2}, {0, 2}, {0, 2}, experts=3)
    row = [0, 2, 0, 2, 1, 2, 1, 2]
    assert copies(row, held, 2) == 4
    out = with_fewer_copies(np.array([row]), held, np.ones((1, 3)), [2] * 4, [2] * 4, 4)
    assert copies(out[0], held, 2) == 0
    assert [sorted(out[0, i:i + 2]) for i in range(0, 8, 2)] == [[1, 2], [1, 2], [0, 2], [0, 2]]


def test_nothing_changes_where_every_cheaper_placement_lifts_the_busiest_rank():
    # Node 0 got expert 2 (a copy, heavy) and node 1 expert 1 (a copy, light), each
    # held by the other; every expert is on its own node (largest = 1: any node set
    # will do). Swapping would copy nothing but put the heavy replica beside node 1's
    # other heavy one: 5 + 5 against 5 + 1 now.
    held = held_as({0, 1}, {2, 3}, experts=4)
    row = [0, 2, 1, 3]
    weights = np.array([[1.0, 1.0, 5.0, 5.0]])
    out = with_fewer_copies(np.array([row]), held, weights, [2, 2], [2, 2], 1)
    assert list(out[0]) == row
    # One slot a rank: the same swap leaves every rank at 5 or less, and is made.
    out = with_fewer_copies(np.array([row]), held, weights, [2, 2], [1, 1], 1)
    assert copies(out[0], held, 2) == 0


def test_too_large_a_re_plan_is_not_searched(monkeypatch):
    held = held_as({1, 2}, {1, 2}, {0, 2}, {0, 2}, experts=3)
    row = np.array([[0, 2, 0, 2, 1, 2, 1, 2]])
    # One step short of FEWEST_STEPS for each of the 8 slot-layers.
    monkeypatch.setattr(fewer_copies, "MOST_STEPS", 8 * fewer_copies.FEWEST_STEPS - 1)
    out = with_fewer_copies(row, held, np.ones((1, 3)), [2] * 4, [2] * 4, 4)
    assert np.array_equal(out, row)


def _fatal(plan, k):
    return fatal_counts(minimal_masks(cube_presence(plan.count_cube), k), len(plan.nodes), k)


@pytest.mark.parametrize("n, gpus, slots, experts, layers, skew, lost", [
    (10, 1, 6, 16, 4, 1.0, 4),  # the paper's nodes
    (6, 2, 2, 8, 3, 0.5, 2),
    (8, 1, 4, 12, 2, 1.5, 2),
    (5, 2, 3, 10, 2, 0.0, 1),
])
def test_a_re_plan_copies_no_more_with_no_layer_busier_and_no_new_fatal_set(
        n, gpus, slots, experts, layers, skew, lost):
    cluster = nodes(n, gpus, slots)
    loads = differing_loads(experts, layers, skew, 5)
    plan = plan_job(cluster, experts, layers, 2, "mro", loads, max_failures=0)
    survivors = cluster[lost:]
    names = {q.name for q in survivors}
    searched = replan(plan, survivors, "NodeLost", names, loads, max_failures=0)
    filled = replan(plan, survivors, "NodeLost", names, loads, max_failures=0,
                    copy_search=False)
    assert [q.name for q in searched.plan.nodes] == [q.name for q in filled.plan.nodes]
    assert np.array_equal(searched.plan.count_cube.sum(axis=1),
                          filled.plan.count_cube.sum(axis=1))

    def per_layer(p):
        return layer_balance(p.slot_matrix, loads, [len(q.ranks) for q in p.nodes],
                             [q.slots_per_rank for q in p.nodes])

    assert (per_layer(searched.plan) <= per_layer(filled.plan) + 1e-9).all()
    k = min(4, len(survivors))
    assert all(a <= b for a, b in zip(_fatal(searched.plan, k), _fatal(filled.plan, k)))
    assert searched.migration.experts_migrated <= filled.migration.experts_migrated


def test_the_paper_setting_re_plan_copies_fewer():
    # The benchmark's paper setting (bench_solver.py: 10 nodes of 6 slots, E = 16, 12
    # layers of rotated zipf 1.0), 4 nodes lost: the fill copies 242 replicas with its
    # busiest rank at 1.0462 the mean; searched, 219 at 1.0407 (the paper's MRO: 214 on
    # average over the benchmark's draws, ranks at 1.58).
    cluster = nodes(10, 1, 6)
    loads = [[1 / (((e + li) % 16) + 1) for e in range(16)] for li in range(12)]
    plan = plan_job(cluster, 16, 12, 2, "mro", loads, max_failures=0)
    survivors = [q for i, q in enumerate(cluster) if i not in (2, 4, 6, 8)]
    result = replan(plan, survivors, "NodeLost", {q.name for q in survivors}, loads,
                    max_failures=0)
    assert result.migration.experts_migrated <= 225
    assert busiest_rank(result.plan, loads) <= 1.0462
