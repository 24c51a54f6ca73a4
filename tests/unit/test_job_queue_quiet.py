"""The node-change window of the operator's job queue: one pass once changes pause, and no
later than the longest wait after the first, however long the changes go on; requests made
meanwhile wait for it; and a pass can tell whether changes came while it ran."""
import threading
import time

from lazarus_operator.job_queue import JobQueue


def _recorder():
    passes, done = [], threading.Event()

    def run_pass(namespace, name):
        passes.append(time.monotonic())
        done.set()

    return JobQueue(run_pass), passes, done


# The quiet time is long against the test's own sleeps, so that a loaded machine oversleeping
# them (CI shares its cores) cannot make a pause the test did not intend.
QUIET_S = 0.3


def test_a_burst_of_changes_gets_one_pass_after_it_pauses():
    queue, passes, done = _recorder()
    start = time.monotonic()
    for _ in range(4):  # 4 changes, each well within the quiet time of the last
        queue.request_when_quiet("ns", "job", QUIET_S, 5.0, "settle")
        last = time.monotonic()
        time.sleep(0.02)
    assert done.wait(5)
    time.sleep(QUIET_S + 0.05)  # no second pass follows
    assert len(passes) == 1
    assert passes[0] - last >= QUIET_S - 0.005
    assert passes[0] - start < 5.0


def test_a_stream_of_changes_cannot_postpone_the_pass_past_the_longest_wait():
    queue, passes, done = _recorder()
    start = time.monotonic()
    while not done.is_set() and time.monotonic() - start < 3:
        queue.request_when_quiet("ns", "job", QUIET_S, 0.1, "settle")  # never quiet that long
        time.sleep(0.01)
    assert passes, "no pass while changes kept coming"
    assert 0.1 - 0.005 <= passes[0] - start < 1.5


def test_a_request_while_changes_are_gathered_waits_for_the_windows_pass():
    queue, passes, done = _recorder()
    queue.request_when_quiet("ns", "job", QUIET_S, 5.0, "settle")
    opened = time.monotonic()
    queue.request("ns", "job")  # e.g. a pod event: a pass now would see only some changes
    assert not passes
    assert done.wait(5)
    time.sleep(QUIET_S + 0.05)
    assert len(passes) == 1 and passes[0] - opened >= QUIET_S - 0.005
    queue.request("ns", "job")  # no window open: at once
    assert len(passes) == 2


def test_a_pass_can_tell_whether_changes_came_after_a_moment():
    queue, _, _ = _recorder()
    before = time.monotonic()
    assert not queue.changed_since("ns", "job", "settle", before)
    queue.request_when_quiet("ns", "job", QUIET_S, 5.0, "settle")
    after = time.monotonic()
    assert queue.changed_since("ns", "job", "settle", before)
    assert not queue.changed_since("ns", "job", "settle", after)
    assert not queue.changed_since("ns", "other", "settle", before)
