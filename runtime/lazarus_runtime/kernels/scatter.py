"""Permute: copy each token's hidden vector to its K slots in the bucket-sorted buffer.

Legend: T tokens, K top-k, D hidden size, P = T*K permuted rows.

The same kernel, scaled by the gate weights, is the backward of the weighted combine
(combine.py) with respect to its permuted input.
"""

import torch

from .backend import tl, triton
from .checks import check_float_2d, check_index_TK, check_weights_TK

# Cap on the [BLOCK_K, BLOCK_D] tile one program moves.
MAX_TILE = 4096


@triton.jit
def _scatter_kernel(
    src_ptr,  # [T, D] one row per token
    rows_ptr,  # int64 [T, K] destination row of each (token, k)
    weights_ptr,  # [T, K] scale of each (token, k); read only if HAS_WEIGHTS
    out_ptr,  # [P, D] out: out[rows[t, k]] = weights[t, k] * src[t]
    top_k,  # K
    hidden,  # D
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_K: tl.constexpr,  # power of two >= K
    BLOCK_D: tl.constexpr,
):
    # int64 offsets: P * D can pass 2**31 for large batches.
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    k = tl.arange(0, BLOCK_K)
    d_mask = d < hidden
    k_mask = k < top_k
    src = tl.load(src_ptr + t * hidden + d, mask=d_mask)
    rows = tl.load(rows_ptr + t * top_k + k, mask=k_mask)
    if HAS_WEIGHTS:
        weights = tl.load(weights_ptr + t * top_k + k, mask=k_mask).to(tl.float32)
        vals = weights[:, None] * src.to(tl.float32)[None, :]
    else:
        vals = tl.broadcast_to(src[None, :], (BLOCK_K, BLOCK_D))
    out_ptrs = out_ptr + rows[:, None] * hidden + d[None, :]
    tl.store(out_ptrs, vals.to(out_ptr.dtype.element_ty), mask=k_mask[:, None] & d_mask[None, :])


def tile_sizes(top_k: int, hidden: int) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_D) for a program that handles all K rows of one token."""
    block_k = triton.next_power_of_2(top_k)
    return block_k, min(triton.next_power_of_2(max(hidden, 1)), max(MAX_TILE // block_k, 1))


def scatter_triton(x_TD: torch.Tensor, rows_TK: torch.Tensor, weights_TK: torch.Tensor | None = None) -> torch.Tensor:
    """[P, D] in x's dtype: out[rows[t, k]] = x[t] (times weights[t, k] if given).

    rows_TK must be a permutation of 0..P-1 (as bucket_positions makes); rows no (t, k) names
    are left unwritten.
    """
    check_index_TK("rows_TK", rows_TK)
    num_tokens, top_k = rows_TK.shape
    check_float_2d("x_TD", x_TD, num_tokens, rows_TK)
    if weights_TK is not None:
        check_weights_TK(weights_TK, rows_TK)
    hidden = x_TD.shape[1]
    out_PD = torch.empty((num_tokens * top_k, hidden), dtype=x_TD.dtype, device=x_TD.device)
    if out_PD.numel() == 0:
        return out_PD
    block_k, block_d = tile_sizes(top_k, hidden)
    grid = (num_tokens, triton.cdiv(hidden, block_d))
    _scatter_kernel[grid](
        x_TD.contiguous(),
        rows_TK.contiguous(),
        weights_TK.contiguous() if weights_TK is not None else rows_TK,
        out_PD,
        top_k,
        hidden,
        HAS_WEIGHTS=weights_TK is not None,
        BLOCK_K=block_k,
        BLOCK_D=block_d,
    )
    return out_PD


def permute_reference(x_TD: torch.Tensor, rows_TK: torch.Tensor) -> torch.Tensor:
    """Plain-torch permute; differentiable through torch autograd."""
    check_index_TK("rows_TK", rows_TK)
    num_tokens, top_k = rows_TK.shape
    check_float_2d("x_TD", x_TD, num_tokens, rows_TK)
    rows_P = rows_TK.reshape(-1)
    token_P = torch.empty_like(rows_P)  # which token each permuted row copies
    token_P[rows_P] = torch.arange(rows_P.numel(), device=rows_P.device) // top_k
    return x_TD[token_P]
