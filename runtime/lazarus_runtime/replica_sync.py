"""Summing each expert's gradient over its replicas with two all-to-alls on the world group.

No per-(layer, expert) process groups: they are what made the paper's reconfiguration take
5-15 s. Instead every expert with replicas on several ranks gets a *leader* among its holders.
Phase 1: every other holder sends the leader its gradient (one uneven all-to-all for all
layers and experts at once). The leader adds the holders' gradients in rank order. Phase 2:
the leader sends the sum back (the same all-to-all with the splits swapped). Every replica
then holds the very same bits, so the replicas stay identical after the optimizer step, and
each rank moves only the gradients of experts it holds rather than a buffer of all experts.

The schedule is pure: every rank derives the same one from the plan.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lazarus_core.plan import ExpertKey

from .collectives import Collectives



@dataclass(frozen=True)
class SyncSchedule:
    """One rank's part: what it sends to each leader and, as a leader, what it sums."""

    send: tuple[tuple[ExpertKey, ...], ...]  # per rank: keys whose gradient goes to that leader
    recv: tuple[tuple[ExpertKey, ...], ...]  # per rank: keys that rank sends here to lead
    lead: tuple[tuple[ExpertKey, tuple[int, ...]], ...]  # keys led here, with their holders
    active: bool  # False when no expert anywhere has replicas on two ranks


def sync_schedule(replicas_LEW: Sequence[np.ndarray], rank: int) -> SyncSchedule:
    """Leaders rotate over each expert's holders so the summing work spreads across ranks."""
    W = replicas_LEW[0].shape[1]
    send = [[] for _ in range(W)]
    recv = [[] for _ in range(W)]
    lead = []
    shared = 0
    for layer, replicas_EW in enumerate(replicas_LEW):
        for expert, row_W in enumerate(replicas_EW):
            holders = tuple(int(j) for j in np.flatnonzero(row_W))
            if len(holders) < 2:
                continue
            leader = holders[shared % len(holders)]
            shared += 1
            key = (layer, expert)
            if rank == leader:
                lead.append((key, holders))
                for h in holders:
                    if h != rank:
                        recv[h].append(key)
            elif rank in holders:
                send[leader].append(key)
    return SyncSchedule(tuple(map(tuple, send)), tuple(map(tuple, recv)), tuple(lead),
                        active=shared > 0)


def sum_over_replicas(schedule: SyncSchedule, grads: dict[ExpertKey, torch.Tensor],
                      comm: Collectives) -> None:
    """Replace every held expert's flat gradient (all of equal length) by its replica sum."""
    if not schedule.active:
        return
    n = next(iter(grads.values())).numel()
    W, me = comm.world_size, comm.rank
    send_splits = [len(keys) * n for keys in schedule.send]
    recv_splits = [len(keys) * n for keys in schedule.recv]
    empty = next(iter(grads.values())).new_empty(0)

    outgoing = torch.cat([empty] + [grads[k] for keys in schedule.send for k in keys])
    incoming = comm.all_to_all(outgoing, recv_splits, send_splits)
    received = {}
    chunks = iter(incoming.view(-1, n))
    for src in range(W):
        for key in schedule.recv[src]:
            received[key, src] = next(chunks)
    for key, holders in schedule.lead:
        total = torch.zeros_like(grads[key])
        for h in holders:  # fixed order: the sum is the same whichever rank leads
            total += grads[key] if h == me else received[key, h]
        grads[key].copy_(total)

    returned = torch.cat([empty] + [grads[k] for keys in schedule.recv for k in keys])
    sums = comm.all_to_all(returned, send_splits, recv_splits)
    chunks = iter(sums.view(-1, n))
    for keys in schedule.send:
        for key in keys:
            grads[key].copy_(next(chunks))
