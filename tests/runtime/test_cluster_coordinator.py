"""The coordinator pod's decisions, against a real store: when a plan from the operator is
published (at once, or at the step boundary), what it waits for, and how a job ends.

The workers' side of the channel is played by hand here (hello, fetched, prepared), so
each decision is visible as the keys the real workers would read."""
import datetime
import threading
import time

import pytest

pytest.importorskip("kubernetes")  # the coordinator talks to the API server

import torch.distributed as dist  # noqa: E402
from lazarus_core.cluster_contract import ExitReport, exit_of  # noqa: E402
from lazarus_core.controller import STALLED, Progress  # noqa: E402
from lazarus_core.plan import member_name  # noqa: E402
from lazarus_core.process_env import new_job_key  # noqa: E402
from lazarus_core.solver import plan_job, replan  # noqa: E402
from lazarus_core.topology import NodeSpec  # noqa: E402

from lazarus_runtime.cluster_coordinator import ClusterCoordinator, Published  # noqa: E402
from lazarus_runtime.job_channel import Hello, JobChannel, RankExit, StepReport  # noqa: E402

NODES = [NodeSpec(f"n{i}", 1, 4, zone=f"z{i % 2}") for i in range(4)]


class Plans:
    def __init__(self):
        self.published: Published | None = None

    def newest(self) -> Published | None:
        return self.published


class State:
    """The job's state ConfigMap, as the coordinator's StateReporter would write it."""

    def __init__(self, inherited: dict[str, str] | None = None):
        self.reports: list[Progress] = []
        self.suspects: dict[str, str] = {}
        self.inherited = inherited or {}
        self.flushed = threading.Event()

    def report(self, progress: Progress) -> None:
        self.reports.append(progress)

    def suspect(self, suspects: dict[str, str]) -> None:
        self.suspects = dict(suspects)

    def flush(self) -> None:
        self.flushed.set()


@pytest.fixture
def job():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    chan, plans, progress = JobChannel(store, new_job_key(), "job"), Plans(), State()
    yield chan, plans, progress
    del store


def first_plan():
    return plan_job(NODES, experts=4, layers=2, min_replicas=2)


def running(chan, plans, progress, **options) -> ClusterCoordinator:
    """A coordinator whose generation 1 is published and adopted by the 4 workers."""
    coord = ClusterCoordinator(chan, plans, progress, **options)
    plans.published = Published(first_plan(), frozenset())
    for n in NODES[:3]:
        chan.hello(member_name(n.name, 0), Hello(n.name))
    coord.tick()
    assert chan.latest() == 0, "published before every worker said hello"
    chan.hello(member_name(NODES[3].name, 0), Hello(NODES[3].name))
    coord.tick()
    assert chan.latest() == 1
    for n in NODES:
        chan.fetched(1, member_name(n.name, 0))
    coord.tick()
    assert coord.steps.adopted is not None
    return coord


def prepare(chan, generation: int, step: int, world: int) -> None:
    for rank in range(world):
        chan.prepare(generation, step, rank, StepReport(loss=1.0, sample_ids=(rank,)))


def test_a_plan_without_a_live_member_is_published_at_once_and_the_step_is_dropped(job):
    chan, plans, progress = job
    coord = running(chan, plans, progress)
    prepare(chan, 1, 1, world=3)  # step 1 half prepared when n3 is lost
    lost = replan(first_plan(), NODES[:3], "NodeLost", {n.name for n in NODES[:3]}).plan
    plans.published = Published(lost, frozenset())

    coord.tick()

    assert chan.latest() == 2
    assert chan.directive(2).start_step == 1  # step 1 is redone under generation 2
    assert chan.committed(1, 1) is None


def test_growth_waits_for_the_joiner_and_then_for_the_step_boundary(job):
    chan, plans, progress = job
    coord = running(chan, plans, progress)
    joiner = NodeSpec("n4", 1, 4, zone="z0")
    grown = replan(first_plan(), NODES + [joiner], "NodeJoined",
                   {n.name for n in NODES}).plan
    plans.published = Published(grown, frozenset())

    prepare(chan, 1, 1, world=4)
    coord.tick()  # the joiner has not said hello: step 1 commits under generation 1
    assert chan.latest() == 1 and chan.committed(1, 1) == 1
    chan.hello("n4/0", Hello("n4"))
    coord.tick()
    assert chan.latest() == 1, "growth must wait for a step boundary"
    prepare(chan, 1, 2, world=4)
    coord.tick()

    # Step 2 is committed and, in the same breath, the workers are sent to generation 2.
    assert chan.committed(1, 2) == 2 and chan.latest() == 2
    directive = chan.directive(2)
    assert directive.start_step == 3 and directive.joiners == ("n4/0",)
    assert [p.step for p in progress.reports] == [1, 2]


def test_a_stalled_plan_is_published_at_once_though_every_member_is_alive(job):
    chan, plans, progress = job
    coord = running(chan, plans, progress)
    again = replan(first_plan(), NODES, STALLED, {n.name for n in NODES}).plan
    plans.published = Published(again, frozenset())

    coord.tick()

    assert chan.latest() == 2 and chan.directive(2).transfers == ()


def finish(chan, plans, progress) -> ClusterCoordinator:
    """A coordinator of a 2-step job that has just committed its last step."""
    coord = running(chan, plans, progress, total_steps=2)
    for step in (1, 2):
        prepare(chan, 1, step, world=4)
        coord.tick()
    assert chan.stopped() and progress.flushed.is_set()
    assert progress.reports[-1].step == 2
    return coord


def look_again(coord: ClusterCoordinator) -> None:
    """Let the next tick read the store (lost_workers reads it at most every BEAT_S)."""
    coord.steps._looked_at = float("-inf")


def test_the_last_step_stops_the_workers_and_the_coordinator_once_they_left(job):
    chan, plans, progress = job
    coord = finish(chan, plans, progress)
    # The workers still read the stop (and write the last checkpoint) through its store.
    coord.tick()
    assert not coord.stopping.is_set()
    members = [member_name(n.name, 0) for n in NODES]
    for m in members[:3]:
        chan.rank_exited(m, RankExit(0, "", "pod"))
    look_again(coord)
    coord.tick()
    assert not coord.stopping.is_set(), "stopped before the last rank left"
    chan.rank_exited(members[3], RankExit(0, "", "pod"))
    look_again(coord)
    coord.tick()
    assert coord.stopping.is_set()
    assert progress.suspects == {}, "ranks that finished were reported lost"


def test_the_finished_line_is_logged_before_the_last_step_is_reported(job, monkeypatch):
    """The state writer may send a report at once, and the operator then marks the job
    Succeeded: whoever reads that must already find "finished" in the coordinator's log."""
    import lazarus_runtime.cluster_coordinator as cc

    chan, plans, progress = job
    said = []
    monkeypatch.setattr(cc, "emit", lambda event, **fields: said.append(event))
    report = progress.report
    monkeypatch.setattr(progress, "report",
                        lambda p: (said.append(f"report {p.step}"), report(p)))
    finish(chan, plans, progress)
    assert said.count("finished") == 1
    assert said.index("finished") < said.index("report 2")


def test_a_finished_job_does_not_wait_for_a_silent_rank(job, monkeypatch):
    from lazarus_core.liveness import Beat

    chan, plans, progress = job
    coord = finish(chan, plans, progress)
    members = [member_name(n.name, 0) for n in NODES]
    for m in members:
        chan.beat(m, Beat(1, 0.0))
    look_again(coord)
    coord.tick()  # every rank beats: it waits
    for m in members[1:]:
        chan.rank_exited(m, RankExit(0, "", "pod"))
    look_again(coord)
    coord.tick()
    assert not coord.stopping.is_set()
    # members[0] never exits but stops beating (its pod went with its node).
    liveness = coord.steps.liveness
    monkeypatch.setattr(time, "monotonic", lambda real=time.monotonic: real() + liveness.silent_s)
    look_again(coord)
    coord.tick()
    assert coord.stopping.is_set()


def test_a_finished_job_stops_waiting_for_a_rank_after_the_bound(job, monkeypatch):
    import lazarus_runtime.cluster_coordinator as cc

    chan, plans, progress = job
    coord = finish(chan, plans, progress)
    coord.tick()  # no rank ever beat or exited (they never started for real)
    assert not coord.stopping.is_set()
    coord.finished_at -= cc.FINISH_WAIT_S + 1
    coord.tick()
    assert coord.stopping.is_set()


def test_a_replacement_coordinator_carries_on_from_what_the_workers_hold(job):
    chan, plans, state = job
    plan = first_plan()
    plans.published = Published(plan, frozenset())
    # Its predecessor committed step 8 and died before n3 saw the commit; it had recorded
    # step 7 (its record lags) and a checkpoint of step 5.
    record = Progress(step=7, generation=1, checkpoint_step=5, restores=1)
    coord = ClusterCoordinator(chan, plans, state, record=record)
    layout = {n.name: tuple(tuple(sorted(set(layer.placement[i]))) for layer in plan.layers)
              for i, n in enumerate(plan.nodes)}
    for n in NODES[:3]:
        chan.hello(member_name(n.name, 0),
                   Hello(f"{n.name}-2", committed=8, holdings=layout[n.name]))
    coord.tick()
    assert chan.latest() == 0, "decided before every worker reconnected"
    chan.hello("n3/0", Hello("n3-2", committed=7, prepared=8, holdings=layout["n3"]))
    coord.tick()

    d = chan.directive(1)
    # Nothing moves and nothing is restored: every worker kept its state in memory.
    assert (d.start_step, d.roll_forward, d.transfers, d.restore_step) == (9, 8, (), None)
    assert chan.checkpoint() == 5 and coord.steps.restores == 1
    assert coord.steps.committed == 8


def test_a_replacement_reports_the_workers_that_never_reconnect(job, monkeypatch):
    import lazarus_runtime.cluster_coordinator as cc

    chan, plans, state = job
    plans.published = Published(first_plan(), frozenset())
    coord = ClusterCoordinator(chan, plans, state, record=Progress(step=7, generation=1))
    for n in NODES[:3]:
        chan.hello(member_name(n.name, 0), Hello(n.name, committed=7, holdings=((0,), (0,))))
    coord.tick()
    assert state.suspects == {}
    coord.started -= cc.RECONNECT_WAIT_S + 1  # the wait is over
    coord.tick()
    assert list(state.suspects) == ["n3/0"] and "did not reconnect" in state.suspects["n3/0"]
    assert chan.latest() == 0  # the operator re-plans without n3; nothing is published yet


def test_a_predecessors_lost_worker_stays_lost_until_it_beats_again(job):
    from lazarus_core.liveness import Beat

    chan, plans, _ = job
    state = State(inherited={"n2/0": "no heartbeat for 3.0 s"})
    plans.published = Published(first_plan(), frozenset())
    coord = ClusterCoordinator(chan, plans, state, record=Progress(step=3, generation=1))
    coord.tick()
    assert state.suspects == {"n2/0": "no heartbeat for 3.0 s"}
    chan.beat("n2/0", Beat(1, 0.0))
    coord.steps._looked_at = 0.0  # the next tick reads the heartbeats
    coord.tick()
    assert "n2/0" not in state.suspects


def test_a_rank_its_agent_saw_exit_is_reported_lost_at_once_by_its_name(job):
    chan, plans, state = job
    coord = running(chan, plans, state)
    chan.rank_exited("n1/0", RankExit(-9, "", "pod-uid-1"))  # its GPU failed; the agent goes on
    coord.steps._looked_at = 0.0  # the next tick reads the store
    coord.tick()
    assert list(state.suspects) == ["n1/0"], state.suspects
    # The operator reads it as that pod's exit.
    assert exit_of(state.suspects["n1/0"]) == ExitReport("pod-uid-1", "exit status -9")
    # Unlike a silent worker, it is not forgotten: it will never come back.
    import lazarus_runtime.cluster_coordinator as cc

    coord.tick()
    coord.lost_since["n1/0"] -= cc.FORGET_LOST_S + 1
    coord.steps._looked_at = 0.0
    coord.tick()
    assert list(state.suspects) == ["n1/0"], state.suspects
