"""The coordinator's one decision: how the workers get from what they hold to a new plan
(lazarus_core.handover): which replicas move from where, and when a checkpoint must be
restored because some expert lost every replica."""
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from lazarus_core.handover import Held, caught_up, held_under, plan_handover, resume_point
from lazarus_core.migration import holdings
from lazarus_core.solver import plan_job, replan
from lazarus_core.topology import NodeSpec


def nodes(*names, slots=4, zone="a"):
    return [NodeSpec(n, 1, slots, zone) for n in names]


def names_of(plan):
    return {n.name for n in plan.nodes}


def survivors_plan(held, alive, generation_reason="NodeLost"):
    up = [NodeSpec(n.name, 1, n.slots, n.zone) for n in held.nodes if n.name in alive]
    return replan(held, up, generation_reason, set(alive)).plan


def test_the_first_plan_starts_from_the_seeded_weights():
    plan = plan_job(nodes("a", "b"), 4, 2, 2)
    h = plan_handover({}, plan, committed=0, checkpoint_step=None)
    assert (h.start_step, h.transfers, h.restore_step, h.joiners) == (1, (), None, ())


def test_a_loss_that_every_expert_survives_moves_only_what_the_new_layout_lacks():
    held = plan_job(nodes("a", "b", "c", "d"), 4, 2, 2)
    alive = {"a", "b", "c"}
    new = survivors_plan(held, alive)
    h = plan_handover(held_under(held, alive, 7), new, committed=7, checkpoint_step=5)
    assert h.restore_step is None and h.start_step == 8 and not h.lost
    before = holdings(held)
    for t in h.transfers:
        assert t.source in alive and t.expert in before[t.source][t.layer]
        assert t.expert not in before[t.destination][t.layer]
    # After the transfers every node holds exactly what the new plan gives it.
    after = {n: [set(l) for l in before[n]] for n in alive}
    for t in h.transfers:
        after[t.destination][t.layer].add(t.expert)
    for i, node in enumerate(new.nodes):
        for li, layer in enumerate(new.layers):
            assert set(layer.placement[i]) <= after[node.name][li]


def test_an_expert_without_a_surviving_replica_restores_the_checkpoint():
    # compact placement puts both replicas of expert 0 on the first node: lose it.
    held = plan_job(nodes("a", "b", "c", "d"), 4, 2, 2, policy="compact")
    holders = {n.name for i, n in enumerate(held.nodes) if 0 in held.layers[0].placement[i]}
    alive = names_of(held) - holders
    h = plan_handover(held_under(held, alive, 23), survivors_plan(held, alive), committed=23,
                      checkpoint_step=20)
    assert h.restore_step == 20 and h.start_step == 21 and (0, 0) in h.lost
    assert h.transfers == ()  # everyone reloads from the checkpoint instead
    none_yet = plan_handover(held_under(held, alive, 23), survivors_plan(held, alive), 23, None)
    assert none_yet.restore_step == 0 and none_yet.start_step == 1


def test_pairs_of_losses_restore_exactly_as_often_as_mro_predicts():
    # Skewed load: some cold experts keep exactly f=2 replicas, so some pairs are fatal.
    loads = [[1, 1, 1, 9]] * 2
    held = plan_job(nodes(*[f"n{i}" for i in range(6)], slots=2), 4, 2, 2, loads=loads)
    assert min(held.layers[0].replicas) == 2
    pairs = list(itertools.combinations(sorted(names_of(held)), 2))
    restores = []
    for pair in pairs:
        alive = names_of(held) - set(pair)
        new = survivors_plan(held, alive)
        restores.append(plan_handover(held_under(held, alive, 9), new, 9, 5).restore_step
                        is not None)
    share = restores.count(False) / len(pairs)
    assert 0 < share < 1
    assert abs(share - held.recovery["2"]) < 1e-9


def test_a_node_leaving_under_a_spot_notice_still_sends_its_experts():
    held = plan_job(nodes("a", "b", "c", "d"), 4, 2, 2, policy="compact")
    noticed = held.nodes[0].name  # compact: it alone holds expert 0
    new = survivors_plan(held, names_of(held) - {noticed}, "SpotNotice")
    h = plan_handover(held_under(held, names_of(held), 4), new, committed=4,
                      checkpoint_step=None)
    assert h.restore_step is None
    assert h.draining == (noticed,) and any(t.source == noticed for t in h.transfers)


def test_the_handover_is_planned_from_the_adopted_layout_not_the_last_published_one():
    # Expert 0 of layer 0 lives on exactly two nodes.
    loads = [[1, 1, 1, 9]] * 2
    gen1 = plan_job(nodes(*[f"n{i}" for i in range(6)], slots=2), 4, 2, 2, loads=loads)
    holders = [n.name for i, n in enumerate(gen1.nodes) if 0 in gen1.layers[0].placement[i]]
    assert len(holders) == 2
    alive = names_of(gen1) - {holders[0]}
    gen2 = survivors_plan(gen1, alive)
    assert plan_handover(held_under(gen1, alive, 3), gen2, 3, 0).restore_step is None
    # The second holder dies before generation 2 was adopted: the copy it was sending may
    # never have arrived, so expert 0 must come from the checkpoint...
    alive -= {holders[1]}
    gen3 = survivors_plan(gen2, alive)
    assert (0, 0) in plan_handover(held_under(gen1, alive, 3), gen3, 3, 0).lost
    # ...whereas had generation 2 been adopted, the new holder would send it.
    assert (0, 0) not in plan_handover(held_under(gen2, alive, 3), gen3, 3, 0).lost


def test_joining_nodes_get_the_dense_state_from_a_survivor_that_stays():
    held = plan_job(nodes("a", "b"), 4, 2, 2)
    new = replan(held, nodes("a", "b", "c"), "NodeJoined", {"a", "b"}).plan
    h = plan_handover(held_under(held, {"a", "b"}, 5), new, committed=5, checkpoint_step=None)
    assert h.joiners == ("c",) and h.dense_source in {"a", "b"}
    assert all(t.destination == "c" or t.source != "c" for t in h.transfers)


def test_the_same_nodes_again_move_nothing():
    held = plan_job(nodes("a", "b", "c"), 4, 2, 2)
    again = replan(held, nodes("a", "b", "c"), "Stalled", names_of(held)).plan
    h = plan_handover(held_under(held, names_of(held), 9), again, committed=9,
                      checkpoint_step=None)
    assert h.transfers == () and h.restore_step is None and h.start_step == 10


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(["mro", "spread", "compact"]), st.integers(3, 6),
       st.sets(st.integers(0, 5), min_size=1, max_size=4), st.integers(0, 3))
def test_restore_exactly_when_some_expert_has_no_live_holder(policy, n, dead, skew):
    names = [f"n{i}" for i in range(n)]
    loads = [[1 + skew * e for e in range(4)]] * 2
    held = plan_job(nodes(*names, slots=3), 4, 2, 2, policy=policy, loads=loads)
    alive = {x for i, x in enumerate(names) if i not in dead}
    if not alive or len(alive) * 3 < 8:
        return  # the survivors cannot hold 4 experts x 2 replicas: no plan to hand over to
    new = survivors_plan(held, alive)
    h = plan_handover(held_under(held, alive, 11), new, committed=11, checkpoint_step=10)
    before = holdings(held)
    surviving = {(li, e) for x in alive for li, es in enumerate(before[x]) for e in es}
    every = {(li, e) for li in range(2) for e in range(4)}
    assert set(h.lost) == every - surviving
    assert (h.restore_step is not None) == bool(every - surviving)
    if h.restore_step is None:
        assert all(t.source in alive for t in h.transfers)


def test_a_worker_behind_the_committed_step_holds_nothing_usable():
    # n1 was frozen for a while: it holds its experts, but as of step 4; the job is at 9.
    held = plan_job(nodes("n0", "n1", "n2"), 4, 2, 2)
    state = held_under(held, {"n0", "n2"}, 9) | held_under(held, {"n1"}, 4)
    h = plan_handover(state, held, committed=9, checkpoint_step=None)
    assert h.joiners == ("n1",) and h.dense_source in {"n0", "n2"}
    assert all(t.source != "n1" for t in h.transfers)
    assert {t.destination for t in h.transfers} == {"n1"}


# --- a replacement coordinator ----------------------------------------------------------

def test_a_replacement_resumes_at_the_highest_step_any_worker_applied():
    # The old coordinator committed step 8 and died: two workers applied it, one had not
    # seen the commit yet and holds step 8 prepared.
    committed, roll = resume_point({"a": (8, None), "b": (8, None), "c": (7, 8)})
    assert (committed, roll) == (8, 8)
    assert caught_up(7, 8, roll) == 8 and caught_up(8, None, roll) == 8
    # Nobody applied it: nothing to roll forward, the step is simply redone.
    assert resume_point({"a": (7, 8), "b": (7, 8)}) == (7, None)
    # A worker far behind (a fresh process, or one that was frozen) cannot catch up.
    assert resume_point({"a": (8, None), "b": (3, None)}) == (8, None)
    assert caught_up(3, None, 8) == 3
    assert resume_point({}) == (0, None)


def test_the_workers_reports_rebuild_the_handover_without_the_old_coordinators_memory():
    plan = plan_job(nodes("a", "b", "c"), 4, 2, 2)
    reported = held_under(plan, {"a", "b", "c"}, 8)
    h = plan_handover(reported, plan, committed=8, checkpoint_step=5, roll_forward=8)
    assert (h.start_step, h.transfers, h.restore_step, h.roll_forward) == (9, (), None, 8)
    # Only "a" reconnected with state ("b" and "c" came back empty): expert holders are
    # what decides, and a restore happens only if the reporters cannot supply every expert.
    lone = {"a": reported["a"]}
    h = plan_handover(lone, plan, committed=8, checkpoint_step=5)
    placed_on_a = {(li, e) for li, es in enumerate(reported["a"].experts) for e in es}
    every = {(li, e) for li in range(2) for e in range(4)}
    assert (h.restore_step is not None) == bool(every - placed_on_a)


def test_held_is_what_each_node_of_the_plan_places():
    plan = plan_job(nodes("a", "b"), 4, 2, 2)
    held = held_under(plan, {"a"}, 3)
    assert list(held) == ["a"] and held["a"] == Held(
        tuple(frozenset(layer.placement[0]) for layer in plan.layers), 3)
