"""Run a function on W real gloo worker processes on 127.0.0.1, with a hard time bound.

The parent hosts the TCPStore, as the local backend will: a worker that dies never takes
the rendezvous with it. Workers return plain Python / numpy values through a queue.
"""
from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
import traceback

import torch
import torch.distributed as dist

from lazarus_runtime.process_group import join_generation, leave_generation


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, args, results):
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False)
        comm = join_generation(store, generation=1, rank=rank, world_size=world_size,
                               timeout_s=60)
        try:
            results.put((rank, True, fn(rank, comm, *args)))
        finally:
            leave_generation(comm)
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_gloo(fn, world_size: int, args=(), timeout_s: float = 120.0,
             allow_dead: set[int] = frozenset()) -> list:
    """``fn(rank, comm, *args)`` on every rank; returns the results in rank order. Ranks in
    ``allow_dead`` may die on purpose (a lost node): their result is None."""
    ctx = mp.get_context("spawn")
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, results),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    out = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            for r in allow_dead:
                if r not in out and procs[r].exitcode is not None:
                    out[r] = None
            if len(out) == world_size:
                break
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                # A worker killed by a signal never reports: fail now, not at the deadline.
                dead = [r for r, p in enumerate(procs)
                        if r not in out and r not in allow_dead and p.exitcode]
                if dead:
                    raise RuntimeError(f"ranks {dead} died without a result") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gloo workers did not finish in {timeout_s:.0f} s")
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        del store
    return [out[r] for r in range(world_size)]
