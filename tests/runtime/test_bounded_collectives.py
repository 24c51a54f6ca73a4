"""A rank waiting on a peer that never joins leaves the collective: on a new plan
generation (the interrupt hook) or at the time bound, never by hanging."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from gloo_harness import run_gloo
from lazarus_runtime.collectives import (Collectives, CollectiveInterrupted, CollectiveTimeout,
                                         failure_reason)

LATE_S = 3.0


def waits(rank: int, comm: Collectives, poll_completion: bool) -> dict:
    comm.poll_completion = poll_completion
    if rank == 1:
        # The peer is stuck; it joins both collectives only much later, so that the
        # abandoned work completes and the group shuts down cleanly for the next test.
        time.sleep(LATE_S)
        for _ in range(2):
            comm.all_reduce_sum_(torch.ones(3))
        return {}
    out = {}
    start = time.monotonic()
    comm.interrupted = lambda: time.monotonic() > start + 0.3
    try:
        comm.all_reduce_sum_(torch.ones(3))
    except CollectiveInterrupted:
        out["interrupted_after"] = time.monotonic() - start
    comm.interrupted, comm.timeout_s = (lambda: False), 0.5
    start = time.monotonic()
    try:
        comm.all_reduce_sum_(torch.ones(3))
    except CollectiveTimeout:
        out["timed_out_after"] = time.monotonic() - start
    time.sleep(LATE_S)
    return out


# False: gloo's own wait blocks the host for a slice; True: the slices poll is_completed(),
# as on NCCL, whose wait only orders the device stream (the same loop, run here on gloo).
POLLING = pytest.mark.parametrize("poll_completion", [False, True],
                                  ids=["host-wait", "completion-polling"])


@pytest.mark.slow
@pytest.mark.timeout(90)
@POLLING
def test_waits_are_interruptible_and_bounded(poll_completion):
    rank0, _ = run_gloo(waits, world_size=2, timeout_s=60, args=(poll_completion,))
    # Generous upper bounds, as the machine is shared: without the bound, rank 0 would
    # wait out the peer's 3 s.
    assert 0.3 <= rank0["interrupted_after"] < 1.5
    assert 0.5 <= rank0["timed_out_after"] < 1.8


class _LateWork:
    """A work item that completes just after a wait slice expired, as gloo's do when a peer
    arrives at the end of the slice; ``error`` is what the finished work raises."""

    def __init__(self, error: Exception | None = None):
        self.error = error
        self.done = False

    def wait(self, timeout=None):
        if not self.done and timeout is not None:
            self.done = True  # the peer's data lands right after the slice's expiry
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise self.error

    def is_completed(self) -> bool:
        return self.done


def test_work_finishing_right_after_a_slice_expires_is_a_success():
    comm = Collectives.single()
    comm.wait(_LateWork())  # no exception: the collective succeeded


def test_work_that_finished_with_an_error_still_raises_it():
    comm = Collectives.single()
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        comm.wait(_LateWork(RuntimeError("Connection closed by peer")))


class _DeviceWork:
    """A work item as NCCL's behaves: ``is_completed`` turns true when the device is done
    (here after ``polls`` looks), also when it failed; ``wait`` never blocks the host, and
    raises the work's error. (``wait`` before completion would only order a stream.)"""

    def __init__(self, polls: int, error: Exception | None = None):
        self.polls, self.error, self.waited = polls, error, False

    def is_completed(self) -> bool:
        self.polls -= 1
        return self.polls <= 0

    def wait(self, timeout=None):
        assert timeout is None, "a device work's wait takes no timeout"
        self.waited = True
        if self.error is not None:
            raise self.error


def test_polling_waits_for_completion_and_then_orders_the_stream():
    comm = Collectives.single()
    comm.poll_completion = True
    work = _DeviceWork(polls=5)
    comm.wait(work)
    assert work.polls == 0 and work.waited


def test_polling_surfaces_the_error_of_a_failed_collective():
    # An aborted NCCL communicator completes its pending work with an error: the survivor
    # must see it, not train on what the collective left in its buffers.
    comm = Collectives.single()
    comm.poll_completion = True
    with pytest.raises(RuntimeError, match="aborted") as raised:
        comm.wait(_DeviceWork(polls=2, error=RuntimeError("NCCL communicator was aborted")))
    assert failure_reason(raised.value).startswith("its communicator was aborted")


def dies_or_reports(rank: int, comm: Collectives, poll_completion: bool) -> dict:
    comm.poll_completion = poll_completion
    comm.all_reduce_sum_(torch.ones(3))  # both are in the group
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # a lost node: the process vanishes
    try:
        comm.all_reduce_sum_(torch.ones(1 << 16))
    except (RuntimeError, CollectiveTimeout) as e:
        return {"raw": str(e), "reason": failure_reason(e)}
    return {}


@pytest.mark.slow
@pytest.mark.timeout(90)
@POLLING
def test_a_dead_peer_is_reported_in_our_words_not_the_backends(poll_completion):
    rank0, _ = run_gloo(dies_or_reports, world_size=2, timeout_s=20, allow_dead={1},
                        args=(poll_completion,))
    assert rank0["reason"] == "a peer went away (its process died or left the group)"
    assert rank0["raw"] != rank0["reason"]



def late_peer(rank: int, comm: Collectives) -> dict:
    if rank == 1:
        time.sleep(0.5)  # ten wait slices late: a joiner still building its model, say
    out = comm.all_to_all(torch.arange(4.0) + 10 * rank, [2, 2], [2, 2])
    return {"got": out.tolist()}


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_peer_a_moment_late_to_a_transfer_still_gets_it():
    # State moves between workers in one all-to-all (state_exchange): its waits are sliced
    # like every collective's, and a peer many slices late must not break it.
    rank0, rank1 = run_gloo(late_peer, world_size=2, timeout_s=30)
    assert rank0["got"] == [0.0, 1.0, 10.0, 11.0]
    assert rank1["got"] == [2.0, 3.0, 12.0, 13.0]
