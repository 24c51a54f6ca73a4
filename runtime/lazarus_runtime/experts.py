"""One rank's experts of one MoE layer, stacked so that a grouped GEMM runs them all at once.

Legend: X rows routed to this rank's experts (grouped by expert), D model dim, F expert FFN
dim, L experts held here.

Each expert is D -> F -> D with GELU: ``gelu(x @ w1_DF + b1_F) @ w2_FD + b2_D``. Stacked over
the L experts a rank holds, one ``torch._grouped_mm`` per projection computes every expert,
given the row offsets on the device: no host synchronisation, no per-expert launches. Where
the device has no grouped GEMM for this dtype and shape, a loop of per-expert matmuls does
the same with the row counts on the host.

Per expert, the parameters keep the names and shapes that migration, checkpoints and the
optimizer state use (the keys of ``STACKED``); ``GroupedExperts`` stacks each of them.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

INIT_STD = 0.02

# Per expert parameter -> the [L, ...] stacked parameter holding it for every local expert.
STACKED = {"w1_DF": "w1_LDF", "b1_F": "b1_LF", "w2_FD": "w2_LFD", "b2_D": "b2_LD"}


def expert_shapes(dim: int, ffn_dim: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of one expert's parameters."""
    return {"w1_DF": (dim, ffn_dim), "b1_F": (ffn_dim,), "w2_FD": (ffn_dim, dim), "b2_D": (dim,)}


def expert_generator(seed: int, layer: int, expert: int) -> torch.Generator:
    # Distinct, stable streams per (layer, expert), independent of which rank builds them.
    return torch.Generator().manual_seed(seed * 1_000_003 + layer * 1009 + expert + 1)


def initial_expert(dim: int, ffn_dim: int, seed: int, layer: int, expert: int) -> dict[str, torch.Tensor]:
    """An expert's initial fp32 parameters, from its own generator: every replica of it, on
    any rank and in any world size, starts with the same bits."""
    generator = expert_generator(seed, layer, expert)
    return {"w1_DF": torch.randn(dim, ffn_dim, generator=generator) * INIT_STD,
            "b1_F": torch.zeros(ffn_dim),
            "w2_FD": torch.randn(ffn_dim, dim, generator=generator) * INIT_STD,
            "b2_D": torch.zeros(dim)}


@dataclass(frozen=True)
class ExpertRows:
    """How many routed rows each local expert gets, grouped in local-expert order."""

    counts_L: torch.Tensor  # int64 on the device
    # The same counts on the host when the dispatcher has them for free; None when reading
    # them would cost a host synchronisation (only the per-expert loop needs them).
    host_counts: tuple[int, ...] | None = None


@functools.cache
def _grouped_mm_runs(device_type: str, device_index: int | None, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs forward and backward here (a probe, once per device)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    device = torch.device(device_type, device_index)
    try:
        x = torch.randn(24, 16, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(3, 16, 8, device=device, dtype=dtype, requires_grad=True)
        offs = torch.tensor([8, 8, 24], device=device, dtype=torch.int32)
        torch._grouped_mm(x, w, offs=offs).float().square().sum().backward()
    except (RuntimeError, NotImplementedError):
        # A device or dtype the kernel does not serve says so by raising: the per-expert
        # loop takes over (tests/runtime/test_model_compute.py checks both agree).
        return False
    return True


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, dim: int, ffn_dim: int) -> bool:
    """Whether the experts of this shape can run as grouped GEMMs on ``device`` in ``dtype``.

    The kernels want every row stride a multiple of 16 bytes; the parameter buffers start
    each tensor aligned (flat_params.ALIGN).
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    if (dim * itemsize) % 16 or (ffn_dim * itemsize) % 16:
        return False
    return _grouped_mm_runs(device.type, device.index, dtype)


class GroupedExperts(nn.Module):
    """This rank's experts of one layer, as [L, ...] stacked parameters.

    ``expert_ids[i]`` is the expert in slot i; the dispatcher delivers rows grouped in that
    order. ``initialise=False`` leaves the parameters empty, for experts whose state comes
    from elsewhere (migration) or whose shapes are all that is wanted.
    """

    def __init__(self, dim: int, ffn_dim: int, layer: int, expert_ids: Sequence[int], seed: int,
                 initialise: bool = True, recompute: bool = False):
        super().__init__()
        self.layer = layer
        self.expert_ids = tuple(expert_ids)
        self.recompute = recompute
        # None: decided from the device at the first forward; tests set it to force a path.
        self.use_grouped_mm: bool | None = None
        L = len(self.expert_ids)
        for piece, shape in expert_shapes(dim, ffn_dim).items():
            setattr(self, STACKED[piece], nn.Parameter(torch.empty(L, *shape)))
        if initialise and L:
            inits = [initial_expert(dim, ffn_dim, seed, layer, e) for e in self.expert_ids]
            with torch.no_grad():
                for piece, stacked in STACKED.items():
                    getattr(self, stacked).copy_(torch.stack([init[piece] for init in inits]))

    def forward(self, x_XD: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
        if self.use_grouped_mm is None:
            self.use_grouped_mm = grouped_mm_supported(x_XD.device, x_XD.dtype,
                                                       self.w1_LDF.shape[1], self.w1_LDF.shape[2])
        compute = self._grouped if self.use_grouped_mm else self._looped
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(compute, x_XD, rows, use_reentrant=False)
        return compute(x_XD, rows)

    def _grouped(self, x_XD: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
        ends_L = torch.cumsum(rows.counts_L, 0)
        offsets_L = ends_L.to(torch.int32)
        # Which expert each row belongs to, as a [X, L] one-hot made by comparisons: the
        # biases then go in and their gradients come out as small matmuls, with no index op
        # whose backward might read sizes back to the host.
        row_X1 = torch.arange(x_XD.shape[0], device=x_XD.device).unsqueeze(1)
        one_hot_XL = ((row_X1 >= ends_L - rows.counts_L) & (row_X1 < ends_L)).to(x_XD.dtype)
        h_XF = F.gelu(torch.addmm(torch._grouped_mm(x_XD, self.w1_LDF, offs=offsets_L),
                                  one_hot_XL, self.b1_LF))
        return torch.addmm(torch._grouped_mm(h_XF, self.w2_LFD, offs=offsets_L),
                           one_hot_XL, self.b2_LD)

    def _looped(self, x_XD: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
        counts = rows.host_counts if rows.host_counts is not None else rows.counts_L.tolist()
        chunks = torch.split(x_XD, list(counts))
        return torch.cat([F.gelu(x @ self.w1_LDF[i] + self.b1_LF[i]) @ self.w2_LFD[i] + self.b2_LD[i]
                          for i, x in enumerate(chunks)])
