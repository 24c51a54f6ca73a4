"""Survivors of a peer that froze (or vanished with its node: its connections stay open,
nothing answers) leave its generation's gloo group and train in the next at once.

Gloo's group destruction waits for its worker threads, and one blocked on such a peer
returns only at the group's timeout, abort or not. Dropped where the survivors' last
reference to it went, the old group cost the next generation that whole timeout (30 s of an
e2e run in containers, where a deleted node's network goes first)."""
from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from gloo_harness import free_port
from lazarus_runtime.collectives import CollectiveInterrupted
from lazarus_runtime.process_group import join_generation, leave_generation
from testcluster.waits import wait_until

pytestmark = pytest.mark.slow

TIMEOUT_S = 20.0  # the groups' own timeout: what a survivor would wait out


def _rank(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    comm = join_generation(store, 1, rank, 3, timeout_s=TIMEOUT_S)
    for _ in range(3):
        comm.all_reduce_sum_(torch.ones(100))
    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen mid-training; the parent kills it
    comm.interrupted = lambda: store.add("generation-2", 0) > 0
    try:
        comm.all_to_all(torch.ones(30, 4), [10] * 3, [10] * 3)
    except CollectiveInterrupted:
        pass
    start = time.monotonic()
    leave_generation(comm, failed=True)
    del comm  # every reference the survivor held: the engine's, a traceback's
    gc.collect()
    comm = join_generation(store, 2, rank, 2, timeout_s=TIMEOUT_S)
    total = comm.all_reduce_sum_(torch.ones(1)).item()
    results.put((rank, total, time.monotonic() - start))
    leave_generation(comm)


def test_survivors_train_in_the_next_generation_at_once_after_a_peer_froze():
    ctx = mp.get_context("spawn")
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, results), daemon=True)
             for r in range(3)]
    for p in procs:
        p.start()
    try:
        wait_until(lambda: psutil.Process(procs[2].pid).status() == psutil.STATUS_STOPPED,
                   timeout=60, what="rank 2 to freeze")
        time.sleep(0.3)  # the survivors are blocked on it in the all-to-all
        store.add("generation-2", 1)  # the coordinator publishes a plan without it
        got = sorted(results.get(timeout=2 * TIMEOUT_S) for _ in range(2))
    finally:
        for p in procs:
            p.kill()
    assert [(rank, total) for rank, total, _ in got] == [(0, 2.0), (1, 2.0)]
    took = [round(s, 2) for _, _, s in got]
    assert max(took) < 5.0, f"leaving and rejoining took {took} s (the timeout is {TIMEOUT_S})"
