"""Token dispatchers: route each (token, top-k slot) to an expert replica and back.

Legend: T tokens, D model dim, E experts, K top-k, W ranks, X rows this rank computes,
L experts held locally.

The interface (as in torchtitan): ``dispatch(x_TD, weights_TK, experts_TK)`` returns the rows
this rank must compute grouped by local expert, how many rows each local expert gets
(``ExpertRows``), and a frozen metadata object; ``combine(y_XD, meta)`` brings expert outputs
back to their tokens and applies the weighted top-k sum. ``LocalDispatcher`` (every expert on
one rank) is the reference; ``ReplicaDispatcher`` implements Algorithm 1 over the replicas of
a plan.

Host synchronisations: the local dispatcher makes none. The replica dispatcher makes one per
call, the read of the all-gathered counts, because the all-to-all needs its split sizes on
the host; everything else it needs on the device goes there without a wait (``to_device``),
and its backward makes none. The indices it hands to the kernels are its own, in range by
construction, so the kernels' range checks (a read each) are skipped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from .collectives import Collectives, all_to_all_autograd
from .dispatch_counts import dispatch_counts
from .experts import ExpertRows
from .host_sync import to_device
from .kernels import bucket_positions, permute, unpermute


class Dispatcher(Protocol):
    local_experts: tuple[int, ...]

    def dispatch(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, experts_TK: torch.Tensor
                 ) -> tuple[torch.Tensor, ExpertRows, object]: ...

    def combine(self, y_XD: torch.Tensor, meta) -> torch.Tensor: ...


@dataclass(frozen=True)
class LocalMeta:
    rows_TK: torch.Tensor      # row of each assignment in the routed buffer
    weights_TK: torch.Tensor
    num_tokens_E: torch.Tensor  # global tokens routed to each expert (for load statistics)


class LocalDispatcher:
    """Single-rank reference: every expert is local, routing is a permutation by expert."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.local_experts = tuple(range(num_experts))

    def dispatch(self, x_TD, weights_TK, experts_TK):
        rows_TK, num_tokens_E = bucket_positions(experts_TK, self.num_experts, check_range=False)
        meta = LocalMeta(rows_TK, weights_TK, num_tokens_E)
        return permute(x_TD, rows_TK, check_range=False), ExpertRows(num_tokens_E), meta

    def combine(self, y_XD, meta: LocalMeta):
        return unpermute(y_XD, meta.rows_TK, meta.weights_TK, check_range=False)


@dataclass(frozen=True)
class ReplicaMeta:
    send_rows_TK: torch.Tensor    # row of each assignment in the send buffer, (dst, expert) order
    weights_TK: torch.Tensor
    send_splits: tuple[int, ...]  # rows sent to each rank
    recv_splits: tuple[int, ...]  # rows received from each rank
    group_rows_X1: torch.Tensor   # received row -> row in the local-expert-grouped buffer
    num_tokens_E: torch.Tensor    # global tokens routed to each expert (for load statistics)


class ReplicaDispatcher:
    """Algorithm 1 across ranks: exact splits to the replicas a plan places, no padding.

    ``replicas_EW[e, j]`` is the number of slots of expert e on rank j in this layer. A rank
    computes each expert it holds once, however many of its slots hold it: its share of the
    expert's tokens is proportional to those slots.
    """

    def __init__(self, replicas_EW: np.ndarray, comm: Collectives):
        replicas_EW = np.asarray(replicas_EW, dtype=np.int64)
        assert replicas_EW.shape[1] == comm.world_size
        self.comm = comm
        self.replicas_EW = replicas_EW
        self.num_experts = replicas_EW.shape[0]
        self.local_experts = tuple(int(e) for e in np.flatnonzero(replicas_EW[:, comm.rank]))
        assert self.local_experts, "every rank has slots, so it holds some expert"
        # Expert id -> position among local experts (-1: not held here, never received).
        self._local_index_E = np.full(self.num_experts, -1, dtype=np.int64)
        self._local_index_E[list(self.local_experts)] = np.arange(len(self.local_experts))

    def dispatch(self, x_TD, weights_TK, experts_TK):
        E, W, me, dev = self.num_experts, self.comm.world_size, self.comm.rank, x_TD.device
        expert_rows_TK, num_local_E = bucket_positions(experts_TK, E, check_range=False)
        tokens_WE = self.comm.all_gather(num_local_E)
        # The one host synchronisation: every rank derives the same (expert, src, dst) counts
        # from the gathered counts, and the all-to-all needs its splits on the host.
        counts_EWW = dispatch_counts(tokens_WE.cpu().numpy().T, self.replicas_EW)
        send_EW = counts_EWW[:, me, :]
        recv_WE = counts_EWW[:, :, me].T
        send_splits = tuple(send_EW.sum(0).tolist())
        recv_splits = tuple(recv_WE.sum(1).tolist())

        # expert_rows_TK orders this rank's assignments by expert, then token; the first
        # send_EW[e, 0] of expert e go to rank 0, the next send_EW[e, 1] to rank 1, ...
        # Flattened (expert, dst) buckets have exactly that layout, so a search over their
        # running totals finds every assignment's destination.
        bucket_ends = to_device(np.cumsum(send_EW.reshape(-1)), dev)
        bucket_TK = torch.searchsorted(bucket_ends, expert_rows_TK, right=True)
        dst_TK = bucket_TK % W
        # The send buffer must be grouped by destination for all_to_all_single.
        send_rows_TK, _ = bucket_positions(dst_TK * E + experts_TK, W * E, check_range=False)
        x_recv = all_to_all_autograd(self.comm, permute(x_TD, send_rows_TK, check_range=False),
                                     recv_splits, send_splits)

        # Received rows arrive grouped by (src, expert); the experts want them by expert.
        recv_local_X = to_device(np.repeat(np.tile(self._local_index_E, W), recv_WE.reshape(-1)),
                                 dev)
        group_rows_X1, num_rows_L = bucket_positions(recv_local_X.unsqueeze(1),
                                                     len(self.local_experts), check_range=False)
        meta = ReplicaMeta(send_rows_TK, weights_TK, send_splits, recv_splits, group_rows_X1,
                           tokens_WE.sum(0))
        rows = ExpertRows(num_rows_L, tuple(recv_WE.sum(0)[list(self.local_experts)].tolist()))
        return permute(x_recv, group_rows_X1, check_range=False), rows, meta

    def combine(self, y_XD, meta: ReplicaMeta):
        ones_X1 = torch.ones(meta.group_rows_X1.shape, dtype=y_XD.dtype, device=y_XD.device)
        y_recv = unpermute(y_XD, meta.group_rows_X1, ones_X1, check_range=False)
        y_back = all_to_all_autograd(self.comm, y_recv, meta.send_splits, meta.recv_splits)
        return unpermute(y_back, meta.send_rows_TK, meta.weights_TK, check_range=False)
