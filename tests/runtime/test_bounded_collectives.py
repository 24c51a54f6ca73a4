"""A rank waiting on a peer that never joins leaves the collective: on a new plan
generation (the interrupt hook) or at the time bound, never by hanging."""
from __future__ import annotations

import time

import pytest
import torch

from gloo_harness import run_gloo
from lazarus_runtime.collectives import Collectives, CollectiveInterrupted, CollectiveTimeout

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
