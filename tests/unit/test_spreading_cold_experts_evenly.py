"""Cold experts spread evenly over the nodes (lazarus_core.anchors.anchor_evenly and
repair_evenly, mro._Shape's second search): where the recovery-best structure packs the
f-replica experts onto a few nodes and leaves the others only heavy replicas, one replica
more at the least, spread so that every node anchors its share, balances the ranks and
recovers better; a re-plan repairs such a plan evenly and moves little."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from lazarus_core import balance, mro, solver
from lazarus_core.anchors import anchor_evenly, anchors_of_presence, even_cover, nodes_of
from lazarus_core.balance import BALANCE_TARGET, busiest_rank
from lazarus_core.recovery import recovery_probability
from lazarus_core.topology import NodeSpec


@pytest.mark.parametrize("n", range(2, 41))
@pytest.mark.parametrize("size", [2, 3, 4, 5])
def test_an_even_cover_puts_every_node_in_equally_many_sets_of_its_group(n, size):
    sets = even_cover(n, size)
    if n < size:
        assert sets == []
        return
    assert all(len(s) == len(set(s)) == size and all(0 <= i < n for i in s) for s in sets)
    covered = Counter(i for s in sets for i in s)
    assert set(covered) == set(range(n))
    left = n % size
    # Plain groups: each node in one set; the ring of size + left nodes: each in size.
    assert sorted(covered.values()) == [1] * (n - size - left if left else n) + (
        [size] * (size + left) if left else [])
    assert len(sets) == (n // size - 1 + size + left if left else n // size)


def zipf(experts: int, layers: int) -> list[list[float]]:
    return [[1 / (((e + l) % experts) + 1) for e in range(experts)] for l in range(layers)]


@pytest.mark.parametrize("n", [24, 26, 28, 32])
def test_even_anchors_give_every_node_its_share_of_count_and_load(n):
    from lazarus_core.allocation import allocate_replicas
    load = zipf(256, 1)[0]
    replicas = allocate_replicas(load, n * 32, 3)
    weights = [t / r for t, r in zip(load, replicas)]
    anchors = anchor_evenly(replicas, weights, [32] * n)
    sets = {sum(1 << i for i in s) for s in even_cover(n, 3)}
    assert set(anchors.cores) <= sets  # every expert on a set of the cover
    count, carried = Counter(), Counter()
    for e, core in enumerate(anchors.cores):
        for i in nodes_of(core):
            count[i] += 1
            carried[i] += weights[e]
    share = 256 * 3 / n
    # Whole numbers of experts per set: a node is off its share by less than one per set
    # it is in (a ring's nodes are in three).
    assert all(abs(c - share) < 3 for c in count.values()), count
    # Dealt heaviest first to the lightest set: no node carries more than one anchor's
    # weight over another (the fill's free replicas even out the rest).
    assert max(carried.values()) - min(carried.values()) <= max(weights), carried


def test_nodes_of_unequal_slots_are_not_spread():
    assert anchor_evenly([3, 3, 3], [1.0, 1.0, 1.0], [4, 4, 8]) is None


# 32 nodes x 2 GPUs x 4 slots, 64 experts (bench_solver.py's 256-GPU case, scaled down): the
# recovery-first search packs the f = 2 cold experts onto a few node pairs, and the ranks
# of the other nodes hold only heavy replicas (1.144 times the mean before this search).
NODES = [NodeSpec(f"node-{i:02d}", 2, 4, zone=f"zone-{i % 4}") for i in range(32)]
EXPERTS, LAYERS = 64, 2
LOADS = zipf(EXPERTS, LAYERS)
SLOTS, GPUS = [8] * 32, [2] * 32


@pytest.fixture(scope="module")
def plan():
    return solver.plan_job(NODES, EXPERTS, LAYERS, 2, "mro", LOADS, max_failures=0)


@pytest.fixture(scope="module")
def shape():
    """The search the plan came from, its first (recovery-first) pass alone."""
    replicas = solver._positions(NODES, EXPERTS, LAYERS, 2, LOADS)[1]
    searched = mro._Shape(replicas, SLOTS, LOADS, GPUS)
    searched.search()
    return searched


def names(mask: int, nodes) -> frozenset[str]:
    return frozenset(nodes[i].name for i in nodes_of(mask))


def fatal_sets(plan, k: int) -> float:
    return (1 - recovery_probability([[list(s) for s in l.placement] for l in plan.layers],
                                     k).probability) * math.comb(len(plan.nodes), k)


def test_the_cold_experts_are_spread_evenly_and_the_ranks_balance(plan, shape):
    assert shape.pick()[1] > BALANCE_TARGET  # the recovery-first choice does not balance
    assert busiest_rank(plan, LOADS) <= BALANCE_TARGET
    assert min(min(l.replicas) for l in plan.layers) == 3  # one more than f at the least
    # Every node anchors light replicas: none is left with only heavy ones.
    for layer in plan.layers:
        cold = {e for e, r in enumerate(layer.replicas) if r == 3}
        assert min(sum(1 for e in node if e in cold) for node in layer.placement) > 0


def test_spreading_recovers_at_least_as_well_as_mro_alone_at_every_failure_count(plan,
                                                                                shape):
    # shape.reference: the fatal sets of the formula's counts on their recovery-best
    # structure (every layer anchored alike, so one layer's are the model's).
    for k, alone in enumerate(shape.reference, start=1):
        assert fatal_sets(plan, k) <= alone + 1e-6, (k, alone)
    assert fatal_sets(plan, 2) == pytest.approx(0)  # no expert on two nodes only


# (Losing one node there breaks one set: its two nodes and a whole set make a ring of five,
# which balances worse than a fresh structure, and the re-plan takes that.)
@pytest.mark.parametrize("lost", [2, 4])
def test_a_plan_spread_evenly_is_repaired_evenly_after_a_loss(plan, lost):
    rng = np.random.default_rng(lost)
    gone = {NODES[i].name for i in rng.choice(len(NODES), lost, replace=False)}
    survivors = [n for n in NODES if n.name not in gone]
    previous, spread = solver.surviving_cores(plan, solver._order(survivors, EXPERTS, LAYERS))
    assert spread == 3  # the plan's cores are an even cover's sets of 3
    result = solver.replan(plan, survivors, "NodeLost", {n.name for n in survivors}, LOADS,
                           max_failures=0)
    after = result.plan
    # The floor stays, so no two nodes hold an expert's every replica; the sets that
    # survived whole keep anchoring experts; the ranks stay near the target.
    assert min(min(l.replicas) for l in after.layers) == 3
    assert fatal_sets(after, 2) == pytest.approx(0)
    order = solver._order(survivors, EXPERTS, LAYERS)
    kept = {names(c, order) for cores in previous for c in cores if c}
    now = anchors_of_presence((after.count_cube > 0).transpose(0, 2, 1),
                              [l.replicas for l in after.layers])
    assert kept & {names(c, after.nodes) for a in now for c in a.cores if c}
    assert busiest_rank(after, LOADS) < 1.15
    assert result.migration.recoverable


def test_a_recovery_best_plan_on_pairs_of_neighbours_is_not_taken_for_spread():
    # 12 nodes x 2 GPUs x 2 slots, 16 experts, zipf 1.5: MRO's structure anchors the cold
    # experts on 4 pairs of neighbours, sets of the even cover too, but on 8 of the nodes.
    nodes = [NodeSpec(f"node-{i:02d}", 2, 2, zone=f"zone-{i % 4}") for i in range(12)]
    loads = [[1 / ((e + l) % 16 + 1) ** 1.5 for e in range(16)] for l in range(2)]
    plan = solver.plan_job(nodes, 16, 2, 2, "mro", loads, max_failures=0)
    cores = {c for a in anchors_of_presence((plan.count_cube > 0).transpose(0, 2, 1),
                                            [l.replicas for l in plan.layers])
             for c in a.cores if c}
    pairs = {frozenset(s) for s in even_cover(12, 2)}
    assert {frozenset(nodes_of(c)) for c in cores} <= pairs
    assert len({i for c in cores for i in nodes_of(c)}) < 12
    survivors = nodes[:-1]
    _, spread = solver.surviving_cores(plan, solver._order(survivors, 16, 2))
    assert spread is None


def test_a_replan_takes_the_option_that_moves_less_among_balances_alike():
    options = [((0, 0), 2, 1.052, "fresh"), ((0, 0), 0, 1.06, "kept")]
    assert mro._ranked(options, 8, 2)[0] == "kept"  # within 1% of the best: alike
    options = [((0, 0), 2, 1.0, "fresh"), ((0, 0), 0, 1.07, "kept")]
    assert mro._ranked(options, 8, 2)[0] == "fresh"
    # Spread evenly, where none balances: only the least moving of those within 5%.
    options = [((0, 0), 2, 1.06, "fresh"), ((0, 0), 0, 1.1, "kept")]
    assert mro._ranked(options, 8, 2, near=True) == ["kept"]
    assert mro._ranked(options, 8, 2) == ["fresh", "kept"]


def test_redealing_a_node_reaches_spreads_that_swaps_of_two_cannot():
    # One node of 8 ranks x 4 slots: 12 heavy replicas (1.9) and 20 light ones. Swaps
    # left the heavy ones two to a rank on six ranks with the lightest elsewhere.
    heavy, light = [1.9] * 12, [0.2 + 0.02 * i for i in range(20)]
    weights = np.array(heavy + light)
    ranks = np.array([r for r in range(6) for _ in range(2)]  # the heavy ones
                     + [6, 6, 6, 6, 7, 7, 7, 7]  # the 8 lightest
                     + [r for r in range(6) for _ in range(2)])
    load = np.bincount(ranks, weights=weights, minlength=8)
    before = load.max()
    assert balance._redeal(ranks, weights, np.array([8]), np.array([4]), load, 8)
    assert np.bincount(ranks, minlength=8).tolist() == [4] * 8  # every rank full
    # Before: two heavy with two of the heavier light ones (4.94); dealt again, the ranks
    # with two heavy ones take light ones from the lighter half.
    assert before == pytest.approx(2 * 1.9 + 0.56 + 0.58)
    assert load.max() <= 2 * 1.9 + 0.58 + 1e-9
    # A layer within the target is left as it is.
    even = np.repeat(np.arange(8), 4)
    flat = np.ones(32)
    assert not balance._redeal(even.copy(), flat, np.array([8]), np.array([4]),
                               np.bincount(even, weights=flat), 8)
