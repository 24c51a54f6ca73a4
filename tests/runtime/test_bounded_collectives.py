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


def waits(rank: int, comm: Collectives) -> dict:
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


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_waits_are_interruptible_and_bounded():
    rank0, _ = run_gloo(waits, world_size=2, timeout_s=60)
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


def dies_or_reports(rank: int, comm: Collectives) -> dict:
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
def test_a_dead_peer_is_reported_in_our_words_not_the_backends():
    rank0, _ = run_gloo(dies_or_reports, world_size=2, timeout_s=20, allow_dead={1})
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
