"""The few collectives a training step uses, over one process group, with bounded waits.

Every collective is issued asynchronously and waited on in short slices. Between slices the
``interrupted`` hook is asked whether a new plan generation has arrived, so a survivor
blocked on a dead or frozen peer leaves the step instead of hanging (design.md, "Failure
handling"). The caller then aborts and rebuilds the group; this module never creates groups.

How one slice waits depends on where the work completes. gloo's ``work.wait(timeout)``
blocks the host until the data is there or the slice expires. NCCL's ``work.wait()`` only
orders the device stream after the collective and returns at once: a dead peer would
surface later, inside some unrelated host synchronisation that nothing can interrupt. So on
NCCL (``poll_completion``) a slice polls ``work.is_completed()``, and the host goes on only
once the collective is really done; a dead peer then never blocks anything but this loop,
and aborting the communicator (``process_group.leave_generation``) frees the device. The
loop itself is the same for both, and tests run the polling variant on gloo too.

Without a group (one rank on gloo) every operation is the identity, so the same engine code
runs a single process without ``torch.distributed``. A group of one (NCCL) is used as is.
"""
from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist


class CollectiveInterrupted(RuntimeError):
    """A new plan generation arrived while this rank waited on a collective."""


class CollectiveTimeout(RuntimeError):
    """A collective did not finish within the bound: a peer is gone or frozen."""


def failure_reason(e: BaseException) -> str:
    """Why a collective (or a group's rendezvous) ended, in our words; the backend's own
    text (gloo's "Connection reset by peer ... GLHF!") is for debug logs."""
    if isinstance(e, CollectiveInterrupted):
        return "a new plan generation interrupted it"
    if isinstance(e, CollectiveTimeout):
        return str(e)
    text = str(e).lower()
    if "abort" in text:
        return "its communicator was aborted (a peer failed or a new generation began)"
    if any(s in text for s in ("connection reset", "connection closed", "broken pipe",
                               "connection refused", "end of file", "remote process exited",
                               "ncclremoteerror")):
        return "a peer went away (its process died or left the group)"
    if "timed out" in text or "timeout" in text:
        return "a peer did not answer in time"
    return f"the process group failed ({type(e).__name__})"


# How long the host sleeps between two looks at a device-side collective: short, as every
# look that misses the completion delays the host's next launch by that much.
_SPIN_S = 50e-6


class Collectives:
    def __init__(self, group: dist.ProcessGroup | None, rank: int, world_size: int,
                 timeout_s: float = 60.0, interrupted: Callable[[], bool] = lambda: False,
                 poll_s: float = 0.05, poll_completion: bool = False,
                 late_completions: bool = True):
        assert group is not None or world_size == 1, "more than one rank needs a group"
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.interrupted = interrupted
        self.poll_s = poll_s
        # True where work completes on a device stream (NCCL): see the module docstring.
        self.poll_completion = poll_completion
        # True where work left behind can still complete later: gloo cannot cancel it, and a
        # frozen peer that resumes answers it (an NCCL communicator's abort cancels it).
        self.late_completions = late_completions

    @classmethod
    def single(cls) -> "Collectives":
        return cls(None, 0, 1)

    def wait(self, work) -> None:
        """Wait for ``work`` in slices of ``poll_s``, checking the interrupt between slices."""
        deadline = time.monotonic() + self.timeout_s
        finished_within = _completed_within if self.poll_completion else _waited_within
        while not finished_within(work, self.poll_s):
            if self.interrupted():
                raise CollectiveInterrupted("a new plan generation interrupted a collective")
            if time.monotonic() > deadline:
                raise CollectiveTimeout(f"a collective did not finish in {self.timeout_s:.0f} s")

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """(W, *x.shape): every rank's ``x``, in rank order."""
        if self.group is None:
            return x.unsqueeze(0).clone()
        # gloo wants the output flat: W copies of x back to back.
        out = x.new_empty(self.world_size * x.numel())
        self.wait(dist.all_gather_into_tensor(out, x.contiguous().view(-1), group=self.group,
                                              async_op=True))
        return out.view(self.world_size, *x.shape)

    def all_reduce_sum_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over ranks in place; every rank ends with the same bits.

        Where abandoned work can complete later, the sum is made in a buffer of its own and
        copied into ``x`` once done: ``x`` is a buffer the next steps use (the gradients), and
        a late sum written into it, long after its step was interrupted, would corrupt
        whatever step is then running."""
        if self.group is not None:
            out = x.clone() if self.late_completions else x
            self.wait(dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group,
                                      async_op=True))
            if out is not x:
                x.copy_(out)
        return x

    def all_to_all(self, x: torch.Tensor, out_splits: Sequence[int],
                   in_splits: Sequence[int]) -> torch.Tensor:
        """Uneven all-to-all of rows: ``in_splits[j]`` rows go to rank j, ``out_splits[j]``
        rows come from it. Not differentiable; see ``all_to_all_autograd``."""
        if self.group is None:
            assert list(out_splits) == list(in_splits)
            return x.clone()
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        self.wait(dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits),
                                         group=self.group, async_op=True))
        return out


def _waited_within(work, slice_s: float) -> bool:
    """Block in the backend's own wait for at most ``slice_s``: True once ``work`` is done."""
    try:
        work.wait(timeout=datetime.timedelta(seconds=slice_s))
        return True
    except RuntimeError as e:
        # gloo reports an expired slice as a timeout; anything else (a peer closing its
        # connection) is a real failure.
        if "timed out" not in str(e).lower():
            raise
    if work.is_completed():
        # It finished between the slice's expiry and this look (peers a slice late hit
        # this every few hundred collectives): a second wait returns at once, or raises
        # the work's own error.
        work.wait()
        return True
    return False


def _completed_within(work, slice_s: float) -> bool:
    """Poll ``work.is_completed()`` for at most ``slice_s``: True once ``work`` is done.

    A failed work counts as completed; the final ``wait()`` raises its error (and, on NCCL,
    orders the current stream after the collective, which costs the host nothing now)."""
    end = time.monotonic() + slice_s
    while not work.is_completed():
        if time.monotonic() >= end:
            return False
        time.sleep(_SPIN_S)
    work.wait()
    return True


class _AllToAll(torch.autograd.Function):
    """The gradient of an all-to-all is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, comm: Collectives, out_splits, in_splits):
        ctx.comm, ctx.out_splits, ctx.in_splits = comm, out_splits, in_splits
        return comm.all_to_all(x, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_to_all(grad, ctx.in_splits, ctx.out_splits), None, None, None


def all_to_all_autograd(comm: Collectives, x: torch.Tensor, out_splits: Sequence[int],
                        in_splits: Sequence[int]) -> torch.Tensor:
    return _AllToAll.apply(x, comm, tuple(out_splits), tuple(in_splits))
