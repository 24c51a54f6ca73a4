"""Joining and leaving the process group of one plan generation.

The rendezvous store is owned by something that outlives workers (the controller, or the
parent process in local mode); each generation's group is scoped under its own prefix of
that store, so a new generation never meets keys left by the previous one. One group per
generation, created once: routing and gradient sums need no other.

The backend follows the tensors: gloo for CPU tensors, NCCL for CUDA tensors when every rank
has a GPU of its own. Ranks that share a GPU (more ranks than GPUs, in tests and demos) use
gloo with CUDA tensors, since NCCL refuses two ranks on one device. Who starts the ranks
knows which case it is (``devices.collective_backend``) and says so; ``join_generation``
checks that every member of a generation agrees.

NCCL differs from gloo where a peer fails: a collective on a dead peer never fails on its
own, and torch's watchdog, once its timeout passes, kills the whole process by default. Our
waits are bounded and interruptible (``collectives``), so the watchdog is told to abort the
communicator only, never the process, and a generation that ends aborts its communicator
itself before it is destroyed (as torchft's reconfigurable NCCL group does): the next
generation gets a fresh one under a fresh prefix.
"""
from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .collectives import Collectives
from .devices import BACKENDS, GLOO, NCCL
from .job_channel import group_store


class JoinInterrupted(RuntimeError):
    """A newer generation arrived while this one was still gathering its members."""


class BackendMismatch(RuntimeError):
    """The members of a generation were started with different collective backends."""


def join_generation(store: dist.Store, generation: int | str, rank: int, world_size: int,
                    timeout_s: float = 60.0, interrupted: Callable[[], bool] = lambda: False,
                    backend: str = GLOO, device: torch.device | str = "cpu",
                    poll_s: float = 0.005) -> Collectives:
    """Initialise the default group for ``generation`` and wrap it for a training step.

    ``init_process_group`` blocks until every member arrives and cannot be interrupted, so
    the members first meet on a store counter that we poll: a member that died after the
    plan was made (its death starts the next generation) then costs no timeout. Alone on
    gloo, a rank needs no group at all; NCCL builds one even for a single rank, so that a
    one-GPU job runs the very path (communicator, abort, rebuild) a larger one does.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if world_size == 1 and backend == GLOO:
        return Collectives.single()
    scope = group_store(store, str(generation))
    # Backend first: once every member has arrived, every member's backend is counted.
    scope.add(f"backend/{backend}", 1)
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
    agreeing = scope.add(f"backend/{backend}", 0)
    if agreeing != world_size:
        raise BackendMismatch(
            f"generation {generation}: {world_size - agreeing} of {world_size} ranks use "
            f"another collective backend than {backend}; every node of a job needs the "
            f"same kind of device (gpusPerNode GPUs each, or none)")
    options, device_id = None, None
    if backend == NCCL:
        options, device_id = _nccl_options(timeout_s), torch.device(device)
    dist.init_process_group(backend, store=dist.PrefixStore("group", scope),
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s),
                            pg_options=options, device_id=device_id)
    return Collectives(dist.group.WORLD, rank, world_size, timeout_s, interrupted,
                       poll_completion=backend == NCCL, late_completions=backend == GLOO)


def _nccl_options(timeout_s: float):
    """A non-blocking communicator (its abort cannot hang on a dead peer), built eagerly by
    ``init_process_group`` (``device_id``) while every member is known to be alive, and a
    watchdog that aborts the communicator but never kills the process (2: "CleanUpOnly")."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    # How long a non-blocking NCCL call (the communicator's creation, an abort) may take.
    os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(max(1, round(timeout_s))))
    options = dist.ProcessGroupNCCL.Options()
    options.config.blocking = False
    return options


# Gloo groups left because a peer failed, each with when it may be dropped. A gloo group's
# destruction joins its worker threads, and one blocked on a peer that vanished without
# closing its connections (a reclaimed node: its network goes first) returns only at the
# group's timeout; its abort does not wake it. Dropped where the last reference happened to
# go (in the training loop), the group made the next generation wait out that timeout (30 s
# in an e2e run) before its first step. Kept here instead until the stuck work has timed
# out, its destruction is then immediate. Meanwhile a frozen peer that resumes may complete
# that work: it writes only into buffers of its own (``Collectives.late_completions``).
_retired: list[tuple[float, dist.ProcessGroup]] = []


def leave_generation(comm: Collectives, failed: bool = False) -> None:
    """Tear the generation's group down. ``failed`` first aborts work a dead or frozen peer
    would never complete; an NCCL communicator is always aborted, since its orderly
    destruction waits for peers that may be gone by now."""
    if comm.group is None:
        return
    gloo = dist.get_backend(comm.group) == GLOO
    if failed or not gloo:
        comm.group.abort()
    now = time.monotonic()
    _retired[:] = [(until, g) for until, g in _retired if until > now]
    if failed and gloo:
        _retired.append((now + comm.timeout_s + 1.0, comm.group))
    dist.destroy_process_group()
