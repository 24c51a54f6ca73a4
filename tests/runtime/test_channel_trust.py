"""The job channel against someone who reaches the store without the job's key: forged,
copied, replayed, deleted and garbage values, bumped counters. Nothing they write is acted
on, nothing crashes a reader, and what they delete or overwrite is written back.

A real c10d TCPStore; the attacker is a second client connection with no key, as a hostile
pod would be. The coordinator's side is the real StepCoordinator; the workers' side is
played by hand, so each key the real workers would read is visible."""
import dataclasses
import datetime

import pytest
import torch.distributed as dist
from lazarus_core.plan import member_name
from lazarus_core.process_env import new_job_key
from lazarus_core.solver import plan_job
from lazarus_core.topology import NodeSpec

from lazarus_runtime.coordination import KEEP_GENERATIONS, StepCoordinator
from lazarus_runtime.job_channel import Directive, Hello, JobChannel, StepReport

NODES = [NodeSpec(f"n{i}", 1, 4, zone="z0") for i in range(4)]
MEMBERS = [member_name(n.name, 0) for n in NODES]  # one rank per node


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    yield master
    del master


@pytest.fixture
def attacker(store):
    """Another connection to the same store, holding no key."""
    return dist.TCPStore("127.0.0.1", store.port, is_master=False,
                         timeout=datetime.timedelta(seconds=10))


def channels(store, key=None, job="job"):
    """The coordinator's channel and a worker's, on two connections, sharing the job's key."""
    key = key or new_job_key()
    worker = dist.TCPStore("127.0.0.1", store.port, is_master=False,
                           timeout=datetime.timedelta(seconds=10))
    return JobChannel(store, key, job, guard_s=0.0), JobChannel(worker, key, job, guard_s=0.0)


def first_plan():
    return plan_job(NODES, experts=4, layers=2, min_replicas=2)


def adopted(coord_chan, workers_chan) -> StepCoordinator:
    steps = StepCoordinator(coord_chan)
    steps.publish(first_plan(), set(MEMBERS))
    for m in MEMBERS:
        workers_chan.fetched(1, m)
    assert steps.poll() is None and steps.adopted is not None
    return steps


def prepare(chan, step, generation=1, world=4):
    for rank in range(world):
        chan.prepare(generation, step, rank, StepReport(loss=1.0, sample_ids=(rank,)))


def test_unsigned_values_are_dropped_and_counted(store, attacker):
    coord, worker = channels(store)
    attacker.set("lazarus/stop", "1")
    attacker.set("lazarus/latest", "7")
    attacker.set("lazarus/commit/1/1", "1")
    attacker.set("lazarus/hello/evil", "1")
    forged_directive = Directive(first_plan(), start_step=1).to_json()
    attacker.set("lazarus/directive/7", "0" * 64 + forged_directive)  # a made-up signature

    assert not worker.stopped() and worker.latest() == 0
    assert worker.committed(1, 1) is None and worker.directive(7) is None
    assert not coord.said_hello("evil")
    assert worker.rejected == 4 and coord.rejected == 1
    # A reader polls: the same forgery is counted each time, but logged once.
    worker.stopped()
    assert worker.rejected == 5


def test_a_worker_whose_hello_is_forged_or_deleted_does_not_look_gone(store, attacker):
    coord, worker = channels(store)
    worker.hello("n0", Hello("incarnation-1", committed=3))
    assert coord.hello_of("n0").committed == 3
    attacker.set("lazarus/hello/n0", "0" * 64 + '{"incarnation": "x", "committed": 999}')
    assert coord.hello_of("n0") == Hello("incarnation-1", committed=3)
    attacker.delete_key("lazarus/hello/n0")
    assert coord.said_hello("n0")
    assert worker.guard() == 1  # and its owner writes it back
    worker.hello("n0", Hello("incarnation-2"))  # a restarted worker is seen as one
    assert coord.hello_of("n0").incarnation == "incarnation-2"


def test_a_signed_value_is_good_only_under_its_own_key_and_job(store, attacker):
    key = new_job_key()
    coord, worker = channels(store, key)
    coord.commit(1, 7, 1)
    signed = attacker.get("lazarus/commit/1/7")
    attacker.set("lazarus/commit/1/8", signed)  # step 7's commit replayed as step 8's
    assert worker.committed(1, 7) == 1 and worker.committed(1, 8) is None
    other_job = JobChannel(worker.store, key, "another-job")  # same key, another job
    assert other_job.committed(1, 7) is None
    assert JobChannel(worker.store, new_job_key(), "job").committed(1, 7) is None


def test_rolling_latest_back_changes_nothing_and_its_owner_restores_it(store, attacker):
    key = new_job_key()
    coord, worker = channels(store, key)
    coord.switch_to(1)
    old = attacker.get("lazarus/latest")
    coord.switch_to(2)
    assert worker.latest() == 2
    attacker.set("lazarus/latest", old)  # a genuine, older value
    assert worker.latest() == 2  # readers only move forward
    assert coord.guard() == 1
    assert JobChannel(attacker, key, "job").latest() == 2


def test_deleted_and_overwritten_keys_come_back_from_their_owners(store, attacker):
    coord, worker = channels(store)
    steps = adopted(coord, worker)
    prepare(worker, 1)
    attacker.delete_key("lazarus/report/1/1/3")  # rank 3's report, before it is read
    assert steps.poll() is None
    # Each rank guards its own report; here one channel plays every rank, and rank 3's is
    # the one it wrote last.
    assert worker.guard() == 1
    prepared = steps.poll()
    assert prepared is not None and prepared.step == 1
    steps.commit(prepared)
    attacker.set("lazarus/commit/1/1", "garbage")
    attacker.delete_key("lazarus/adopted/1")
    assert worker.committed(1, 1) is None
    assert coord.guard() == 2
    assert worker.committed(1, 1) == 1 and worker.wait_adopted(1, timeout_s=1)


def test_a_bumped_counter_and_forged_reports_commit_nothing(store, attacker):
    coord, worker = channels(store)
    steps = adopted(coord, worker)
    attacker.add("lazarus/prepared/1/1", 100)
    assert steps.poll() is None  # the counter says "look"; there is nothing signed to see
    for rank in range(4):
        attacker.set(f"lazarus/report/1/1/{rank}", '{"loss": 0.0, "sample_ids": []}')
    assert steps.poll() is None and coord.rejected >= 1
    attacker.add("lazarus/fetched/2", 100)
    assert not coord.all_fetched(2, MEMBERS)
    prepare(worker, 1)  # the genuine reports replace the forged ones
    prepared = steps.poll()
    assert prepared is not None and [r.sample_ids for r in prepared.reports] == [
        (0,), (1,), (2,), (3,)]


@pytest.mark.parametrize("garbage", [b"", b"1", b"\xff" * 80, b"0" * 64, b"x" * 100_000,
                                     b"0" * 64 + b'{"plan": 1}'])
def test_garbage_crashes_no_reader(store, attacker, garbage):
    coord, worker = channels(store)
    steps = adopted(coord, worker)
    assert worker.latest() == 1
    for key in ("latest", "stop", "directive/1", "directive/2", "commit/1/1", "adopted/2",
                "hello/n0", "timings/1/0", "checkpoint", "ckpt/1/1/0", "report/1/1/0",
                "fetched/1/n0"):
        attacker.set(f"lazarus/{key}", garbage)
    attacker.add("lazarus/prepared/1/1", 4)
    attacker.add("lazarus/ckpt/1/1", 4)
    assert worker.latest() == 1  # seen before the garbage, and never goes back
    assert not worker.stopped() and worker.directive(2) is None
    assert worker.committed(1, 1) is None and worker.checkpoint() is None
    assert worker.checkpoint_shards(1, 1, 1) is None and worker.timings(1, 0) is None
    assert steps.poll() is None and not coord.said_hello("n0")
    assert worker.wait_directive(1, timeout_s=1) is not None  # its owner wrote it back


def test_the_store_stays_the_same_size_however_long_the_job_runs(store):
    """Every step's keys and every old generation's are pruned: the key count after 40
    steps and 6 generations equals the count after 10 steps and 3 generations."""
    coord, worker = channels(store)
    steps = StepCoordinator(coord)
    alive = set(MEMBERS)
    counts = []
    step = 0
    for generation in range(1, 7):
        directive = steps.publish(dataclasses.replace(first_plan(), generation=generation),
                                  alive)
        for m in MEMBERS:
            worker.fetched(generation, m)
        # The process groups' rendezvous keys c10d leaves behind, one per rank.
        for rank in range(4):
            store.set(f"lazarus/gen{generation}/group/0//cpu//0/{rank}", "addr")
        steps.poll()
        for _ in range(directive.start_step, directive.start_step + 8):
            step += 1
            prepare(worker, step, generation)
            worker.report_timings(generation, 0, {"rebuild_s": 0.1})
            prepared = steps.poll()
            steps.commit(prepared)
            worker.wait_commit(generation, step, timeout_s=1)
        counts.append(len(store.list_keys()))
    assert counts[KEEP_GENERATIONS] == counts[-1], counts
