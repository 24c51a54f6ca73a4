"""Autograd Functions over the Triton launchers; the torch references need none."""

import torch

from .combine import combine_triton, weight_grad_triton
from .scatter import scatter_triton


class PermuteFunction(torch.autograd.Function):
    """x_TD -> x_PD; the backward sums the K copies' gradients back into each token."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, rows_TK: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows_TK)
        return scatter_triton(x_TD, rows_TK)

    @staticmethod
    def backward(ctx, grad_PD: torch.Tensor):
        (rows_TK,) = ctx.saved_tensors
        return combine_triton(grad_PD, rows_TK), None


class UnpermuteFunction(torch.autograd.Function):
    """(y_PD, weights_TK) -> out_TD; the backward scatters weighted gradients and dots for the weights."""

    @staticmethod
    def forward(ctx, y_PD: torch.Tensor, rows_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y_PD, rows_TK, weights_TK)
        return combine_triton(y_PD, rows_TK, weights_TK)

    @staticmethod
    def backward(ctx, grad_TD: torch.Tensor):
        y_PD, rows_TK, weights_TK = ctx.saved_tensors
        grad_y = grad_weights = None
        if ctx.needs_input_grad[0]:
            grad_y = scatter_triton(grad_TD, rows_TK, weights_TK)
        if ctx.needs_input_grad[2]:
            grad_weights = weight_grad_triton(grad_TD, y_PD, rows_TK, weights_TK.dtype)
        return grad_y, None, grad_weights
