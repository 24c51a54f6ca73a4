"""Parameters kept in flat buffers, with fp32 master weights under bf16.

Legend: N elements of a flat buffer.

The model's parameters become views into one flat buffer, and their gradients views into a
second, so autograd accumulates straight into it and a collective can sum every gradient in
place. What the optimizer steps are the *masters*: an fp32 buffer holding every parameter.

- Under fp32 the parameters are their own masters: nothing is copied.
- Under bf16 the model computes with bf16 parameters, views into a bf16 buffer (one region
  at the front of the layout). After the backward their bf16 gradients are cast into the
  masters' gradients in one kernel, and after the optimizer step the masters are cast back
  into the model in one kernel. Nothing is cast per parameter.
- Parameters that compute in fp32 whatever the precision (the router) sit behind the bf16
  region and are their own masters.

Views start on ALIGN-element boundaries: grouped GEMMs want 16-byte aligned operands.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

ALIGN = 64


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in the flat buffers."""

    offset: int
    shape: torch.Size

    @property
    def numel(self) -> int:
        return self.shape.numel()


class FlatParams:
    """Named parameters moved into flat buffers; see the module docstring.

    ``spare`` elements at the end of the master gradient buffer belong to no parameter:
    values that ride along in the gradients' all-reduce (the loss) go there.
    """

    def __init__(self, named: Sequence[tuple[str, nn.Parameter]], compute_dtype: torch.dtype,
                 keep_fp32: Callable[[str], bool] = lambda name: False, spare: int = 0):
        casts = compute_dtype != torch.float32
        low = [(n, p) for n, p in named if casts and not keep_fp32(n)]
        high = [(n, p) for n, p in named if not (casts and not keep_fp32(n))]
        device = named[0][1].device if named else torch.device("cpu")
        self.slots: dict[str, Slot] = {}
        end = 0
        for group in (low, high):
            for name, p in group:
                self.slots[name] = Slot(end, p.shape)
                end = _aligned(end + p.numel())
            if group is low:
                self.low_numel = end
        self.numel = end
        self.master = torch.zeros(end, dtype=torch.float32, device=device)
        self.master_grad = torch.zeros(end + spare, dtype=torch.float32, device=device)
        self.spare = self.master_grad[end:]
        with torch.no_grad():
            for name, p in named:
                self.master_view(name).copy_(p.detach())
        self.low = self.master[:self.low_numel].to(compute_dtype)
        self.low_grad = torch.zeros_like(self.low)
        for name, p in low:
            p.data = self.view_of(self.low, name)
            p.grad = self.view_of(self.low_grad, name)
        for name, p in high:
            p.data = self.master_view(name)
            p.grad = self.master_grad_view(name)

    def view_of(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        slot = self.slots[name]
        return flat[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def master_view(self, name: str) -> torch.Tensor:
        return self.view_of(self.master, name)

    def master_grad_view(self, name: str) -> torch.Tensor:
        return self.view_of(self.master_grad, name)

    def zero_grads(self) -> None:
        self.low_grad.zero_()
        self.master_grad.zero_()

    def gather_grads(self) -> None:
        """The model's gradients into the masters' (a cast, under bf16)."""
        if self.low_numel:
            self.master_grad[:self.low_numel].copy_(self.low_grad)

    def publish(self) -> None:
        """The masters' values into the model (a cast, under bf16)."""
        if self.low_numel:
            self.low.copy_(self.master[:self.low_numel])
