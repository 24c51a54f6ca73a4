"""Unpermute: the weighted top-k combine of the bucket-sorted rows back into token order.

Legend: T tokens, K top-k, D hidden size, P = T*K permuted rows.

Without weights the combine kernel is the backward of permute (scatter.py): each token sums the
gradients of its K copies.
"""

import torch

from .backend import tl, triton
from .checks import check_float_2d, check_index_TK, check_weights_TK
from .scatter import row_tile

# Cap on the [BLOCK_K, BLOCK_D] tile a weight-gradient program reduces at a time.
WEIGHT_GRAD_TILE = 4096


@triton.jit
def _combine_kernel(
    src_ptr,  # [P, D] bucket-sorted rows
    rows_ptr,  # int64 [T, K] row of each (token, k) in src
    weights_ptr,  # [T, K] gate weight of each (token, k); read only if HAS_WEIGHTS
    out_ptr,  # [T, D] out: out[t] = sum_k weights[t, k] * src[rows[t, k]]
    hidden,  # D
    TOP_K: tl.constexpr,  # K
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < hidden
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        row = tl.load(rows_ptr + t * TOP_K + k)
        vals = tl.load(src_ptr + row * hidden + d, mask=d_mask, other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            vals = vals * tl.load(weights_ptr + t * TOP_K + k).to(tl.float32)
        acc += vals
    tl.store(out_ptr + t * hidden + d, acc.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _weight_grad_kernel(
    grad_out_ptr,  # [T, D] gradient of the combine's output
    src_ptr,  # [P, D] the combine's bucket-sorted input
    rows_ptr,  # int64 [T, K] row of each (token, k) in src
    grad_weights_ptr,  # [T, K] out: grad_out[t] . src[rows[t, k]]
    top_k,  # K
    hidden,  # D
    BLOCK_K: tl.constexpr,  # power of two >= K
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    k_mask = k < top_k
    rows = tl.load(rows_ptr + t * top_k + k, mask=k_mask, other=0)
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for d0 in range(0, hidden, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_mask = d < hidden
        grad = tl.load(grad_out_ptr + t * hidden + d, mask=d_mask, other=0.0).to(tl.float32)
        src_ptrs = src_ptr + rows[:, None] * hidden + d[None, :]
        src = tl.load(src_ptrs, mask=k_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(src * grad[None, :], axis=1)
    tl.store(grad_weights_ptr + t * top_k + k, acc.to(grad_weights_ptr.dtype.element_ty), mask=k_mask)


def _check_combine_args(y_PD: torch.Tensor, rows_TK: torch.Tensor, weights_TK: torch.Tensor | None) -> None:
    check_index_TK("rows_TK", rows_TK)
    check_float_2d("y_PD", y_PD, rows_TK.numel(), rows_TK)
    if weights_TK is not None:
        check_weights_TK(weights_TK, rows_TK)


def combine_triton(y_PD: torch.Tensor, rows_TK: torch.Tensor, weights_TK: torch.Tensor | None = None) -> torch.Tensor:
    """[T, D] in y's dtype: out[t] = sum_k weights[t, k] * y[rows[t, k]] (weights 1 if None)."""
    _check_combine_args(y_PD, rows_TK, weights_TK)
    num_tokens, top_k = rows_TK.shape
    hidden = y_PD.shape[1]
    out_TD = torch.empty((num_tokens, hidden), dtype=y_PD.dtype, device=y_PD.device)
    if out_TD.numel() == 0:
        return out_TD
    block_d, num_warps = row_tile(hidden)
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block_d))](
        y_PD.contiguous(),
        rows_TK.contiguous(),
        weights_TK.contiguous() if weights_TK is not None else rows_TK,
        out_TD,
        hidden,
        TOP_K=top_k,
        HAS_WEIGHTS=weights_TK is not None,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )
    return out_TD


def weight_grad_triton(
    grad_out_TD: torch.Tensor, y_PD: torch.Tensor, rows_TK: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """[T, K] in `dtype`: the gradient of the combine with respect to its weights."""
    _check_combine_args(y_PD, rows_TK, None)
    num_tokens, top_k = rows_TK.shape
    check_float_2d("grad_out_TD", grad_out_TD, num_tokens, rows_TK)
    grad_weights_TK = torch.empty((num_tokens, top_k), dtype=dtype, device=y_PD.device)
    if num_tokens == 0:
        return grad_weights_TK
    if y_PD.shape[1] == 0:
        return grad_weights_TK.zero_()
    block_k = triton.next_power_of_2(top_k)
    block_d = max(min(triton.next_power_of_2(y_PD.shape[1]), WEIGHT_GRAD_TILE // block_k), 1)
    _weight_grad_kernel[(num_tokens,)](
        grad_out_TD.contiguous(),
        y_PD.contiguous(),
        rows_TK.contiguous(),
        grad_weights_TK,
        top_k,
        y_PD.shape[1],
        BLOCK_K=block_k,
        BLOCK_D=block_d,
    )
    return grad_weights_TK


def unpermute_reference(y_PD: torch.Tensor, rows_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """Plain-torch unpermute, accumulating in fp32 like the kernel; differentiable through torch autograd."""
    _check_combine_args(y_PD, rows_TK, weights_TK)
    y_TKD = y_PD[rows_TK].float()
    return (y_TKD * weights_TK.float().unsqueeze(-1)).sum(1).to(y_PD.dtype)
