"""Token-dispatch kernels: bucket counts, stable slot assignment, permute and weighted unpermute.

Each op has a Triton kernel and a plain-torch reference; kernel_backend() says which one runs.
Legend for shape suffixes: T tokens, K top-k, D hidden size, B buckets, P = T*K permuted rows.
"""

from .backend import kernel_backend
from .ops import bucket_counts, bucket_positions, permute, unpermute

__all__ = ["bucket_counts", "bucket_positions", "kernel_backend", "permute", "unpermute"]
