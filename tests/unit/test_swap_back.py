"""A re-plan's fill swaps replicas back to nodes that held them where no rank of the layer
passes its busiest and recovery cannot change (swap_back.py)."""
from __future__ import annotations

import numpy as np
import pytest

from lazarus_core import solver, swap_back
from lazarus_core.balance import busiest_rank
from lazarus_core.solver import plan_job, replan
from lazarus_core.swap_back import swapped_back
from lazarus_sim.workload import differing_loads

from layer_shapes import held_as, nodes


def copies(placements, held, slots=2):
    """(node, expert)s placed that the node did not hold."""
    nodes_of = np.repeat(np.arange(held.shape[1]), slots)
    placed = {(int(n), int(e)) for n, e in zip(nodes_of, placements[0])}
    return sum(not held[0, n, e] for n, e in placed)


def swap(row, held, weights, largest=1):
    return swapped_back(np.array([row]), held, np.array([weights], dtype=float),
                        [2] * held.shape[1], [1] * held.shape[1], largest)


def test_two_copies_that_trade_places_go_back_where_they_were():
    # Node 0 held 0 and 1, node 1 held 2 and 3; the fill gave node 0 expert 2 and node 1
    # expert 1. One slot a rank, every replica alike: swapping moves nothing.
    held = held_as({0, 1}, {2, 3}, experts=4)
    row = [0, 2, 1, 3]
    assert copies(np.array([row]), held) == 2
    out = swap(row, held, [1.0] * 4)
    assert copies(out, held) == 0
    assert sorted(out[0]) == sorted(row)  # the same replicas, so the same counts


def test_no_swap_lifts_a_rank_above_the_busiest_of_the_layer():
    held = held_as({0, 1}, {2, 3}, experts=4)
    row = [0, 2, 1, 3]
    # One slot a rank: ranks 1, 5, 1, 5 become 1, 1, 5, 5, none above 5: swapped.
    assert copies(swap(row, held, [1.0, 1.0, 5.0, 5.0]), held) == 0
    # Two slots a rank: ranks (0 + 2), (1 + 3) = 6, 6 would become (0 + 1), (2 + 3) = 10, 2.
    out = swapped_back(np.array([row]), held, np.array([[5.0, 5.0, 1.0, 1.0]]), [2, 2],
                       [2, 2], 1)
    assert list(out[0]) == row


def test_experts_on_fewer_nodes_than_the_largest_core_keep_their_nodes():
    # Each expert is on one node: with largest = 2 a swap could change a fatal set.
    held = held_as({0, 1}, {2, 3}, experts=4)
    out = swap([0, 2, 1, 3], held, [1.0] * 4, largest=2)
    assert list(out[0]) == [0, 2, 1, 3]


def test_a_swap_saving_two_copies_goes_before_one_saving_one():
    # Node 0 holds 0 and 1 but got expert 4 (a copy); expert 1 went, as a copy, to node 1
    # (which held nothing of use) and to node 2 (which held 4). The swap with node 2 saves
    # both copies; the one with node 1, first in slot order, would save one and leave
    # node 2's copy of 1.
    held = held_as({0, 1}, {6, 7}, {4, 5}, experts=8)
    out = swapped_back(np.array([[0, 4, 6, 1, 1, 5]]), held, np.ones((1, 8)), [2, 2, 2],
                       [1, 1, 1], 1)
    assert list(out[0]) == [0, 1, 6, 1, 4, 5]
    assert copies(out, held) == 1  # node 1's copy of 1 stays


@pytest.mark.parametrize("rounds", [swap_back.ROUNDS, 1])
def test_a_copy_left_by_a_swap_goes_back_on_the_next_pass(monkeypatch, rounds):
    # Three nodes each got the next one's expert: no pair trades places. Node 0 takes 1
    # back from node 1 and gives it 4, a copy node 2 held; the next pass swaps that with
    # node 2's copy of 2, which node 1 held.
    monkeypatch.setattr(swap_back, "ROUNDS", rounds)
    held = held_as({0, 1}, {2, 3}, {4, 5}, experts=6)
    out = swapped_back(np.array([[0, 4, 1, 3, 2, 5]]), held, np.ones((1, 6)), [2, 2, 2],
                       [1, 1, 1], 1)
    assert copies(out, held) == (0 if rounds > 1 else 2)


@pytest.mark.parametrize("swapping", [True, False])
def test_a_re_plan_moves_less_with_the_same_balance_and_fatal_sets(monkeypatch, swapping):
    # 24 nodes x 2 GPUs x 4 slots, E = 48, 3 layers of zipf 0.4-1.0, after losing two
    # nodes: the fill copies 224 replicas, swapped back 223 (the benchmark's 256 GPUs after
    # losing 4: 14,090 -> 13,873).
    if not swapping:
        monkeypatch.setattr(solver, "swapped_back", lambda placements, *_: placements)
    cluster, loads = nodes(24, 2, 4), differing_loads(48, 3, 0.7, 3)
    plan = plan_job(cluster, 48, 3, 2, "mro", loads, max_failures=0)
    survivors = [n for n in cluster if n.name not in ("node-03", "node-07")]
    # (Without the search for fewer copies after the swaps: fewer_copies.py.)
    result = replan(plan, survivors, "NodeLost", {n.name for n in survivors}, loads,
                    max_failures=0, copy_search=False)
    assert busiest_rank(result.plan, loads) == pytest.approx(1.1346, abs=1e-4)
    assert solver._fatal_sets(result.plan) == [0, 0]
    assert result.migration.experts_migrated == (223 if swapping else 224)
