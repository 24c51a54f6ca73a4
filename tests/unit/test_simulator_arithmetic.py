"""Hand-computable runs: the simulator's samples and time breakdown equal the arithmetic.

Every model here has expert_fraction 0, so a step takes step_s whatever the plan, and costs
that are exact in binary: a 0.5 s step, a 2 GB state written at 1 GB/s (2 s) and read at
2 GB/s (1 s), a restart of 3 s + 1 s.
"""
import pytest

from lazarus_sim.engine import CATEGORIES
from lazarus_sim.strategies import CheckpointRestart, ElasticRestart, Lazarus
from lazarus_sim.trace import Event, make_trace
from lazarus_sim.workload import Costs, ModelSpec
from lazarus_core.topology import NodeSpec

MODEL = ModelSpec("toy", experts=1, layers=1, expert_mb=500, dense_gb=1.5, step_s=0.5,
                  expert_fraction=0.0, batch_per_gpu=4)
COSTS = Costs(checkpoint_gb_per_s=1.0, restore_gb_per_s=2.0, restart_s=3.0, detect_s=1.0,
              rebuild_s=2.0, link_gb_per_s=0.5)
NODE = NodeSpec("template", 1, 1)
LOADS = [[1.0]]


def trace(nodes, duration, *events):
    joins = [Event(0.0, "join", f"node-{i}") for i in range(nodes)]
    return make_trace("hand", joins + [Event(t, k, n) for t, k, n in events], duration)


def breakdown(result):
    return {c: result.seconds[c] for c in CATEGORIES if result.seconds[c]}


def test_state_and_costs_are_what_the_arithmetic_below_assumes():
    assert MODEL.state_gb == 2.0
    assert COSTS.checkpoint_s(MODEL) == 2.0 and COSTS.restart_total_s(MODEL) == 4.0


@pytest.mark.parametrize("cls", [CheckpointRestart, ElasticRestart])
def test_no_failures_is_steps_and_checkpoints_only(cls):
    # Cycles of 10 steps (5 s) + a checkpoint (2 s): 10 cycles in 70 s.
    r = cls(MODEL, COSTS, 10, NODE, 2, LOADS).run(trace(2, 70.0))
    assert (r.steps, r.samples) == (100, 100 * 2 * 4)
    assert breakdown(r) == {"compute": 50.0, "checkpoint": 20.0}
    assert r.counts["checkpoints"] == 10


def test_lazarus_without_failures_never_reconfigures():
    r = Lazarus(MODEL, COSTS, 10, NODE, 2, LOADS, min_replicas=1, rebalance_every=1000).run(
        trace(2, 70.0))
    assert (r.steps, r.samples) == (100, 800)
    assert breakdown(r) == {"compute": 50.0, "checkpoint": 20.0}


def test_checkpoint_restart_one_failure():
    # 0-5 train (10 steps), 5-7 checkpoint, 7-11 train 8 steps, node-1 lost: those 4 s are
    # lost; wait for the replacement until 20; restart 20-24; 24-29 train (step 20), 29-31
    # checkpoint, 31-36 train (step 30), 36-38 checkpoint, 38-40 train 4 steps.
    r = CheckpointRestart(MODEL, COSTS, 10, NODE, 2, LOADS).run(
        trace(2, 40.0, (11.0, "lose", "node-1"), (20.0, "join", "node-2")))
    assert (r.steps, r.samples) == (34, 34 * 8)
    assert breakdown(r) == {"compute": 17.0, "lost": 4.0, "waiting": 9.0, "restart": 4.0,
                            "checkpoint": 6.0}
    assert r.curve[-1] == (40.0, 272)
    assert (11.0, 80) in r.curve  # the rollback shows as a drop to the checkpoint


def test_elastic_restart_one_failure_then_growth_after_a_checkpoint():
    # 3 nodes: 0-5 train, 5-7 checkpoint, 7-11 train (lost), restart on 2 nodes 11-15,
    # 15-20 train steps 10-20, 20-22 checkpoint; node-3 joined at 16, so restart on 3 nodes
    # 22-26; 26-30 train 8 steps.
    r = ElasticRestart(MODEL, COSTS, 10, NODE, 3, LOADS).run(
        trace(3, 30.0, (11.0, "lose", "node-1"), (16.0, "join", "node-3")))
    assert r.steps == 28
    assert r.samples == 10 * 12 + 10 * 8 + 8 * 12
    assert breakdown(r) == {"compute": 14.0, "lost": 4.0, "restart": 8.0, "checkpoint": 4.0}
    assert r.counts["restarts"] == 2


def test_lazarus_one_failure_reconfigures_in_place():
    # One expert with a replica on each of 3 nodes. Lost at 10.25: the quarter step in flight
    # is redone; the survivors hold the expert already, so the reconfiguration is detection
    # and rebuild only, 1 s + 2 s (10.25-13.25). The replacement joins at 20 mid-step; the
    # step ends at 20.25, then one replica moves to it: no detection, 2 s + 0.5 GB at
    # 0.5 GB/s = 3 s (20.25-23.25). 23.25-30 trains 13 steps and a quarter.
    job = Lazarus(MODEL, COSTS, 1000, NODE, 3, LOADS, min_replicas=2, rebalance_every=1000)
    r = job.run(trace(3, 30.0, (10.25, "lose", "node-1"), (20.0, "join", "node-3")))
    assert r.steps == 20 + 14 + 13
    assert r.samples == 20 * 12 + 14 * 8 + 13 * 12
    assert breakdown(r) == pytest.approx({"compute": 23.75, "lost": 0.25,
                                          "reconfiguration": 6.0}, abs=1e-9)
    assert (r.counts["reconfigurations"], r.counts["experts_migrated"]) == (2, 1)
    assert r.counts["restores"] == 0


def test_lazarus_restores_from_checkpoint_when_every_replica_is_lost():
    # f = 1 on 2 nodes x 1 slot and 2 experts: each expert on one node. Losing node-0 loses
    # an expert for good. Lazarus waits for a node to hold the model again, then reloads the
    # checkpoint (rebuild 2 s + read 1 s; the loss was detected while it waited).
    model = ModelSpec("toy2", experts=2, layers=1, expert_mb=250, dense_gb=1.5, step_s=0.5,
                      expert_fraction=0.0)
    job = Lazarus(model, COSTS, 10, NODE, 2, [[1.0, 1.0]], min_replicas=1, rebalance_every=1000)
    r = job.run(trace(2, 20.0, (9.0, "lose", "node-0"), (10.0, "join", "node-2")))
    # 0-5 train, 5-7 checkpoint, 7-9 train 4 steps (lost), wait 9-10 (1 slot < 2 experts),
    # restore 10-13, 13-18 train to step 20, 18-20 checkpoint.
    assert r.counts["restores"] == 1
    assert r.steps == 20
    assert breakdown(r) == {"compute": 10.0, "lost": 2.0, "waiting": 1.0, "restart": 3.0,
                            "checkpoint": 4.0}


def test_lazarus_moves_off_a_node_under_spot_notice_before_it_goes():
    # Notice for node-1 at 10.25: the step in flight ends at 10.5, then a planned
    # reconfiguration without node-1 (the survivors hold the expert: rebuild only, 2 s, no
    # detection) commits at 12.5. The loss at 13 then costs nothing: 12.5-30 trains 35 steps
    # on 2 nodes.
    job = Lazarus(MODEL, COSTS, 1000, NODE, 3, LOADS, min_replicas=2, rebalance_every=1000,
                  use_notices=True)
    r = job.run(trace(3, 30.0, (10.25, "notice", "node-1"), (13.0, "lose", "node-1")))
    assert (r.steps, r.samples) == (21 + 35, 21 * 12 + 35 * 8)
    assert breakdown(r) == {"compute": 28.0, "reconfiguration": 2.0}
    assert r.counts["failures"] == 0
