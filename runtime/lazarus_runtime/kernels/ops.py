"""The public token-dispatch ops: range-check the indices, then run the kernels or the torch reference.

Legend: T tokens, K top-k, D hidden size, B buckets, P = T*K permuted rows.

A range check reads the indices' extremes back to the host: on a GPU, a synchronisation.
Indices that come from outside are checked; a caller that built them itself (the dispatcher's
own slots and bucket ids, in range by construction) passes ``check_range=False``.
"""

import torch

from .autograd import PermuteFunction, UnpermuteFunction
from .backend import use_triton
from .checks import check_index_range, check_index_TK, check_num_buckets
from .combine import unpermute_reference
from .counts import (
    bucket_counts_reference,
    bucket_counts_triton,
    bucket_positions_reference,
    bucket_positions_triton,
)
from .scatter import permute_reference


def _check_bucket_ids(bucket_ids_TK: torch.Tensor, num_buckets: int, check_range: bool) -> None:
    check_index_TK("bucket_ids_TK", bucket_ids_TK)
    check_num_buckets(num_buckets)
    if check_range:
        check_index_range("bucket_ids_TK", bucket_ids_TK, num_buckets)


def _check_rows(rows_TK: torch.Tensor, check_range: bool) -> None:
    check_index_TK("rows_TK", rows_TK)
    if check_range:
        check_index_range("rows_TK", rows_TK, rows_TK.numel())


def bucket_counts(bucket_ids_TK: torch.Tensor, num_buckets: int, *, check_range: bool = True) -> torch.Tensor:
    """int64 [B]: how many (token, k) assignments go to each bucket."""
    _check_bucket_ids(bucket_ids_TK, num_buckets, check_range)
    impl = bucket_counts_triton if use_triton(bucket_ids_TK) else bucket_counts_reference
    return impl(bucket_ids_TK, num_buckets)


def bucket_positions(
    bucket_ids_TK: torch.Tensor, num_buckets: int, *, check_range: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows_TK int64 [T, K], counts_B int64 [B]): each assignment's row in a bucket-sorted buffer.

    Bucket b owns rows offsets[b] .. offsets[b] + counts[b] - 1, offsets being the exclusive
    prefix sum of counts. Within a bucket, rows follow the flattened index t*K + k, so the
    first rows of a bucket are its earliest tokens.
    """
    _check_bucket_ids(bucket_ids_TK, num_buckets, check_range)
    impl = bucket_positions_triton if use_triton(bucket_ids_TK) else bucket_positions_reference
    return impl(bucket_ids_TK, num_buckets)


def permute(x_TD: torch.Tensor, rows_TK: torch.Tensor, *, check_range: bool = True) -> torch.Tensor:
    """x_PD with x_PD[rows[t, k]] = x_TD[t]. rows_TK must be a permutation of 0..P-1, as from bucket_positions."""
    _check_rows(rows_TK, check_range)
    if use_triton(x_TD):
        return PermuteFunction.apply(x_TD, rows_TK)
    return permute_reference(x_TD, rows_TK)


def unpermute(
    y_PD: torch.Tensor, rows_TK: torch.Tensor, weights_TK: torch.Tensor, *, check_range: bool = True
) -> torch.Tensor:
    """out_TD with out[t] = sum_k weights[t, k] * y_PD[rows[t, k]], accumulated in fp32, in y's dtype."""
    _check_rows(rows_TK, check_range)
    if use_triton(y_PD):
        return UnpermuteFunction.apply(y_PD, rows_TK, weights_TK)
    return unpermute_reference(y_PD, rows_TK, weights_TK)
