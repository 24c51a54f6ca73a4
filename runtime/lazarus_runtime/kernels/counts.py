"""Per-bucket counts and the stable slot assignment built from their prefix sums.

Legend: T tokens, K top-k, B buckets, P = T*K assignments, N blocks of BLOCK assignments.

A bucket is whatever the dispatcher groups by: an expert, or a (destination rank, expert)
pair. The slot of assignment i = t*K + k in bucket b is offsets[b] plus the number of earlier
assignments in b, so a bucket's rows keep token order. The dispatcher relies on that order to
send the first rows of an expert to one rank and the next rows to another.
"""

import torch

from .backend import tl, triton
from .checks import check_index_TK, check_num_buckets

# The slot kernel compares every pair in a block ([BLOCK, BLOCK] work per block), which keeps
# it independent of B; 128 keeps that tile small.
SLOT_BLOCK = 128
COUNT_BLOCK = 1024


@triton.jit
def _count_kernel(
    ids_ptr,  # int64 [P] bucket id per assignment
    counts_ptr,  # int32 [N, B] or [1, B], zeroed; row pid * row_stride receives this block's counts
    num_assignments,  # P
    row_stride,  # B for per-block counts, 0 to accumulate every block into one row
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_assignments
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    tl.atomic_add(counts_ptr + pid * row_stride + ids, 1, mask=mask)


@triton.jit
def _slot_kernel(
    ids_ptr,  # int64 [P] bucket id per assignment
    block_starts_ptr,  # int32 [N, B] first row of bucket b for block n's assignments
    rows_ptr,  # int64 [P] out: destination row per assignment
    num_assignments,  # P
    num_buckets,  # B
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    lane = tl.arange(0, BLOCK)
    offs = pid * BLOCK + lane
    mask = offs < num_assignments
    # Masked lanes get id -1, which matches no real bucket, so they never count as earlier.
    ids = tl.load(ids_ptr + offs, mask=mask, other=-1)
    same_bucket_before = (ids[:, None] == ids[None, :]) & (lane[:, None] > lane[None, :])
    rank_in_block = tl.sum(same_bucket_before.to(tl.int32), axis=1)
    start = tl.load(block_starts_ptr + pid * num_buckets + ids, mask=mask, other=0)
    tl.store(rows_ptr + offs, (start + rank_in_block).to(tl.int64), mask=mask)


def _launch_counts(ids_P: torch.Tensor, num_buckets: int, per_block: bool, block: int) -> torch.Tensor:
    num_blocks = triton.cdiv(ids_P.numel(), block)
    counts = torch.zeros((num_blocks if per_block else 1, num_buckets), dtype=torch.int32, device=ids_P.device)
    if num_blocks:
        _count_kernel[(num_blocks,)](ids_P, counts, ids_P.numel(), num_buckets if per_block else 0, BLOCK=block)
    return counts


def bucket_counts_triton(bucket_ids_TK: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """int64 [B]: assignments per bucket. Ids must lie in [0, num_buckets)."""
    check_index_TK("bucket_ids_TK", bucket_ids_TK)
    check_num_buckets(num_buckets)
    ids_P = bucket_ids_TK.contiguous().view(-1)
    return _launch_counts(ids_P, num_buckets, per_block=False, block=COUNT_BLOCK)[0].to(torch.int64)


def bucket_positions_triton(bucket_ids_TK: torch.Tensor, num_buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows int64 [T, K], counts int64 [B]): the stable slot assignment. Ids must lie in [0, num_buckets)."""
    check_index_TK("bucket_ids_TK", bucket_ids_TK)
    check_num_buckets(num_buckets)
    ids_P = bucket_ids_TK.contiguous().view(-1)
    counts_NB = _launch_counts(ids_P, num_buckets, per_block=True, block=SLOT_BLOCK)
    counts_B = counts_NB.sum(0, dtype=torch.int32)
    # Prefix sums over the N x B table (P / SLOT_BLOCK rows, so small for the few thousand
    # buckets a dispatcher uses) are one torch cumsum kernel each; a Triton scan would only
    # add code.
    bucket_starts_B = torch.cumsum(counts_B, 0, dtype=torch.int32) - counts_B
    block_starts_NB = bucket_starts_B + torch.cumsum(counts_NB, 0, dtype=torch.int32) - counts_NB
    rows_P = torch.empty_like(ids_P)
    if ids_P.numel():
        _slot_kernel[(counts_NB.shape[0],)](
            ids_P, block_starts_NB, rows_P, ids_P.numel(), num_buckets, BLOCK=SLOT_BLOCK
        )
    return rows_P.view(bucket_ids_TK.shape), counts_B.to(torch.int64)


def bucket_counts_reference(bucket_ids_TK: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Plain-torch bucket_counts.

    A scatter-add, not ``torch.bincount``: bincount sizes its output from the largest id, which
    on a GPU is a read back to the host.
    """
    check_index_TK("bucket_ids_TK", bucket_ids_TK)
    check_num_buckets(num_buckets)
    ids_P = bucket_ids_TK.reshape(-1)
    counts_B = torch.zeros(num_buckets, dtype=torch.int64, device=ids_P.device)
    return counts_B.scatter_add_(0, ids_P, torch.ones_like(ids_P))


def bucket_positions_reference(bucket_ids_TK: torch.Tensor, num_buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch bucket_positions: a stable sort by bucket, inverted."""
    counts_B = bucket_counts_reference(bucket_ids_TK, num_buckets)
    ids_P = bucket_ids_TK.reshape(-1)
    order_P = torch.argsort(ids_P, stable=True)
    rows_P = torch.empty_like(ids_P)
    rows_P[order_P] = torch.arange(ids_P.numel(), device=ids_P.device)
    return rows_P.view(bucket_ids_TK.shape), counts_B
