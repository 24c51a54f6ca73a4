"""Joining and leaving the process group of one plan generation.

The rendezvous store is owned by something that outlives workers (the controller, or the
parent process in local mode); each generation's group is scoped under its own prefix of
that store, so a new generation never meets keys left by the previous one. One group per
generation, created once: routing and gradient sums need no other.
"""
from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import torch.distributed as dist

from .collectives import Collectives
from .job_channel import group_store


class JoinInterrupted(RuntimeError):
    """A newer generation arrived while this one was still gathering its members."""


def join_generation(store: dist.Store, generation: int | str, rank: int, world_size: int,
                    timeout_s: float = 60.0, interrupted: Callable[[], bool] = lambda: False,
                    backend: str = "gloo", poll_s: float = 0.005) -> Collectives:
    """Initialise the default group for ``generation`` and wrap it for a training step.

    ``init_process_group`` blocks until every member arrives and cannot be interrupted, so
    the members first meet on a store counter that we poll: a member that died after the
    plan was made (its death starts the next generation) then costs no timeout.

    gloo serves CPU tensors (the tests, the local demo); CUDA tensors need ``nccl``.
    """
    if world_size == 1:
        return Collectives.single()
    scope = group_store(store, str(generation))
    scope.add("arrived", 1)
    deadline = time.monotonic() + timeout_s
    while scope.add("arrived", 0) < world_size:
        if interrupted():
            raise JoinInterrupted(f"generation {generation} was superseded while its "
                                  f"members gathered")
        if time.monotonic() > deadline:
            raise TimeoutError(f"generation {generation}: not every member arrived within "
                               f"{timeout_s:.0f} s")
        time.sleep(poll_s)
    dist.init_process_group(backend, store=dist.PrefixStore("group", scope),
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return Collectives(dist.group.WORLD, rank, world_size, timeout_s, interrupted)


def leave_generation(comm: Collectives, failed: bool = False) -> None:
    """Tear the generation's group down; ``failed`` first aborts work a dead or frozen peer
    would never complete."""
    if comm.group is None:
        return
    if failed:
        comm.group.abort()
    dist.destroy_process_group()
