"""Argument checks shared by the kernel launchers and the torch references.

Legend: T tokens, K top-k, D hidden size, B buckets, P = T*K permuted rows.

Shape and dtype checks are free and run on every path. Range checks read values back to the
host (one device sync), so only the public functions run them, once per call.
"""

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Counts and in-block ranks are int32 inside the kernels.
MAX_ASSIGNMENTS = 2**31 - 1


def check_index_TK(name: str, index_TK: torch.Tensor) -> None:
    """An int64 [T, K] index tensor (bucket ids or destination rows) with K >= 1."""
    if not isinstance(index_TK, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(index_TK).__name__}")
    if index_TK.dim() != 2:
        raise ValueError(f"{name} must be 2-D [tokens, top_k], got shape {tuple(index_TK.shape)}")
    if index_TK.shape[1] < 1:
        raise ValueError(f"{name} must have top_k >= 1 columns, got shape {tuple(index_TK.shape)}")
    if index_TK.dtype != torch.int64:
        raise ValueError(f"{name} must be int64, got {index_TK.dtype}")
    if index_TK.numel() > MAX_ASSIGNMENTS:
        raise ValueError(f"{name} has {index_TK.numel()} entries; at most {MAX_ASSIGNMENTS} are supported")


def check_num_buckets(num_buckets: int) -> None:
    if isinstance(num_buckets, bool) or not isinstance(num_buckets, int) or num_buckets < 1:
        raise ValueError(f"num_buckets must be a positive int, got {num_buckets!r}")


def check_float_2d(name: str, x: torch.Tensor, rows: int, like: torch.Tensor) -> None:
    """A float [rows, *] tensor on the same device as `like`."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(x.shape)}")
    if x.shape[0] != rows:
        raise ValueError(f"{name} must have {rows} rows to match rows_TK, got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    if x.device != like.device:
        raise ValueError(f"{name} is on {x.device} but rows_TK is on {like.device}")


def check_weights_TK(weights_TK: torch.Tensor, rows_TK: torch.Tensor) -> None:
    if not isinstance(weights_TK, torch.Tensor):
        raise ValueError(f"weights_TK must be a torch.Tensor, got {type(weights_TK).__name__}")
    if weights_TK.shape != rows_TK.shape:
        raise ValueError(
            f"weights_TK must have the shape of rows_TK {tuple(rows_TK.shape)}, got {tuple(weights_TK.shape)}"
        )
    if weights_TK.dtype not in FLOAT_DTYPES:
        raise ValueError(f"weights_TK must be float32, float16 or bfloat16, got {weights_TK.dtype}")
    if weights_TK.device != rows_TK.device:
        raise ValueError(f"weights_TK is on {weights_TK.device} but rows_TK is on {rows_TK.device}")


def check_index_range(name: str, index_TK: torch.Tensor, upper: int) -> None:
    """Every entry in [0, upper): a kernel would otherwise read or write out of bounds."""
    if index_TK.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(index_TK))
    if lo < 0 or hi >= upper:
        raise ValueError(f"{name} must lie in [0, {upper}), found values in [{lo}, {hi}]")
