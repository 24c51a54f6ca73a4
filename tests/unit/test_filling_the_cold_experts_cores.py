"""Counts whose cold experts fill the cores they are anchored on
(``allocation.filling_cores``), and the fresh plan that takes them at once where the
search's traded counts do not balance (``mro._Shape.cores_filled``)."""
import numpy as np
import pytest

from lazarus_core import mro
from lazarus_core.allocation import allocate_many, even_out, filling_cores
from lazarus_core.anchor_search import forget_anchors
from lazarus_core.balance import BALANCE_TARGET, busiest_rank
from lazarus_core.solver import plan_job
from lazarus_core.topology import NodeSpec


def _loads(experts: int, skews, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.array([rng.permutation(1 / np.arange(1, experts + 1) ** s) for s in skews])


@pytest.mark.parametrize("seed", range(4))
def test_the_coldest_experts_fill_whole_cores_within_their_share(seed):
    slots, node_slots = 512, 16  # 32 nodes of 16 slots
    loads = _loads(64, [0.6, 0.9, 1.2, 1.5, 1.8], seed)
    before = np.array(even_out(allocate_many(loads, slots, 2), loads, 32))
    after = np.array(filling_cores(before.tolist(), loads, node_slots))
    assert (after.sum(axis=1) == slots).all()
    filled = 0
    for r0, r, t in zip(before, after, loads):
        had = int((r0 == 2).sum())
        if not had:
            assert (r == r0).all()  # nothing to fill
            continue
        cold = r == 2
        cores = -(-had // node_slots)
        assert cold.sum() <= cores * node_slots  # no more cores of 2 nodes than before
        assert t[cold].max() <= t[~cold].min()  # the coldest experts
        assert t[cold].sum() <= t.sum() * 2 * cores * node_slots / slots + 1e-12
        assert (r[~cold] >= 3).all()
        filled += cold.sum() > had
    assert filled  # the cores took more cold experts somewhere


def test_where_slots_are_tight_the_others_keep_three_replicas_each():
    loads = _loads(16, [1.5], 0)
    counts = np.array(filling_cores([[2] * 14 + [3, 3]], loads, 4)[0])  # 34 slots
    assert counts.sum() == 34 and (counts == 2).sum() in (14, 15)  # one at least stays above
    assert (counts[counts != 2] >= 3).all()


def _plan(nodes, loads):
    forget_anchors()
    return plan_job(nodes, len(loads[0]), len(loads), 2, "mro", loads=loads, max_failures=4)


def test_a_plan_the_search_cannot_balance_takes_the_filled_cores(monkeypatch):
    # 12 nodes x 8 GPUs x 2 slots, E = 32: the search alone ends at 1.063 with these
    # recovery figures; the cold experts' cores filled balance at 1.028 with the same.
    nodes = [NodeSpec(f"n{i:02d}", 8, 2, zone=f"z{i % 3}") for i in range(12)]
    loads = [[1 / (((e + layer) % 32) + 1) for e in range(32)] for layer in range(4)]
    plan = _plan(nodes, loads)
    monkeypatch.setattr(mro._Shape, "cores_filled", lambda self, options: None)
    searched = _plan(nodes, loads)
    assert busiest_rank(searched, loads) > BALANCE_TARGET
    assert busiest_rank(plan, loads) <= BALANCE_TARGET
    assert all(plan.recovery[k] >= searched.recovery[k] - 1e-9 for k in searched.recovery)


def test_filled_cores_that_do_not_balance_leave_the_search_as_it_was(monkeypatch):
    # 8 nodes x 4 GPUs x 4 slots, E = 32: the filled cores are weighed and not taken, and
    # what weighing them added is taken back: the plan is the search's alone.
    nodes = [NodeSpec(f"n{i}", 4, 4, zone=f"z{i % 3}") for i in range(8)]
    loads = [[1 / (((e + layer) % 32) + 1) for e in range(32)] for layer in range(4)]
    weighed, made = [], []
    cores_filled, counts_of = mro._Shape.cores_filled, mro.filling_cores

    def made_counts(*args):
        made.append(counts_of(*args))
        return made[-1]

    def spy(self, options):
        before = (len(self.variants), set(self.templates), set(self.filled_options))
        weighed.append(cores_filled(self, options))
        assert before == (len(self.variants), set(self.templates), set(self.filled_options))
        return weighed[-1]
    monkeypatch.setattr(mro, "filling_cores", made_counts)
    monkeypatch.setattr(mro._Shape, "cores_filled", spy)
    plan = _plan(nodes, loads)
    assert made and weighed and not any(weighed)
    monkeypatch.setattr(mro._Shape, "cores_filled", lambda self, options: None)
    assert (_plan(nodes, loads).slot_matrix == plan.slot_matrix).all()


def test_cores_that_could_hold_every_expert_leave_one_for_the_slots_left():
    # 36 slots, E = 16, 15 experts at the floor: one core of nodes of 16 slots could hold
    # all 16 at 2 replicas, 32 slots; one stays above it to take the 4 left.
    loads = _loads(16, [1.5], 0)
    counts = np.array(filling_cores([[2] * 15 + [6]], loads, 16)[0])
    assert counts.sum() == 36 and (counts > 2).sum() >= 1
