"""Permute: copy each token's hidden vector to its K slots in the bucket-sorted buffer.

Legend: T tokens, K top-k, D hidden size, P = T*K permuted rows.

The same kernel, scaled by the gate weights, is the backward of the weighted combine
(combine.py) with respect to its permuted input.
"""

import torch

from .backend import tl, triton
from .checks import check_float_2d, check_index_TK, check_weights_TK

# A program moves BLOCK_D elements of one token's row, as a 1-D tile, and loops over the K
# copies in a loop unrolled at compile time (TOP_K is a constexpr). The 2-D [K, D] tiles this
# replaced reached only 0.40 of copy_ in the unpermute at top-8 with D = 7168 (gpu-notes.md);
# with 1-D tiles each thread keeps its share of the sum over K in registers and the K row
# loads are issued back to back. The new figure is still to be measured on a GPU.
MAX_BLOCK_D = 1024


@triton.jit
def _scatter_kernel(
    src_ptr,  # [T, D] one row per token
    rows_ptr,  # int64 [T, K] destination row of each (token, k)
    weights_ptr,  # [T, K] scale of each (token, k); read only if HAS_WEIGHTS
    out_ptr,  # [P, D] out: out[rows[t, k]] = weights[t, k] * src[t]
    hidden,  # D
    TOP_K: tl.constexpr,  # K
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # int64 offsets: P * D can pass 2**31 for large batches.
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < hidden
    src = tl.load(src_ptr + t * hidden + d, mask=d_mask)
    for k in tl.static_range(TOP_K):
        row = tl.load(rows_ptr + t * TOP_K + k)
        if HAS_WEIGHTS:
            vals = tl.load(weights_ptr + t * TOP_K + k).to(tl.float32) * src.to(tl.float32)
        else:
            vals = src
        tl.store(out_ptr + row * hidden + d, vals.to(out_ptr.dtype.element_ty), mask=d_mask)


def row_tile(hidden: int) -> tuple[int, int]:
    """(BLOCK_D, num_warps) for a program that moves one token's row in 1-D tiles.

    Up to 1024 elements a program, eight per thread: 16-byte accesses in bf16.
    """
    block_d = min(triton.next_power_of_2(max(hidden, 1)), MAX_BLOCK_D)
    return block_d, max(1, min(8, block_d // 256))


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
    block_d, num_warps = row_tile(hidden)
    grid = (num_tokens, triton.cdiv(hidden, block_d))
    _scatter_kernel[grid](
        x_TD.contiguous(),
        rows_TK.contiguous(),
        weights_TK.contiguous() if weights_TK is not None else rows_TK,
        out_PD,
        hidden,
        TOP_K=top_k,
        HAS_WEIGHTS=weights_TK is not None,
        BLOCK_D=block_d,
        num_warps=num_warps,
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
