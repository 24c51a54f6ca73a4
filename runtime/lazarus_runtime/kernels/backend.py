"""Which implementation the token-dispatch ops run: the Triton kernels or the torch reference."""

import functools
import logging
import types

import torch

log = logging.getLogger("lazarus.kernels")

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:
    # Stand-ins let the kernel modules import for their torch references; no kernel is ever
    # launched because kernel_backend() is then "torch".
    triton = types.SimpleNamespace(jit=lambda fn: fn)
    tl = types.SimpleNamespace(constexpr=int)
    HAVE_TRITON = False

# Triton chooses between compiling and interpreting when a kernel is decorated, that is when
# this package is imported. The interpreter can run our kernels only if it was on then.
KERNELS_INTERPRETED = HAVE_TRITON and triton.knobs.runtime.interpret


def interpreting() -> bool:
    """Whether CPU tensors go through the interpreted kernels now.

    Read at each call, so that a test can turn the interpreter on for its own ops and leave
    every other test on the fast torch reference.
    """
    return KERNELS_INTERPRETED and triton.knobs.runtime.interpret


@functools.cache
def _cuda_present() -> bool:
    return torch.cuda.is_available()


def kernel_backend() -> str:
    """"triton" where Triton can run (a CUDA device, or its CPU interpreter), else "torch"."""
    if not HAVE_TRITON:
        return _logged("torch", "triton is not installed")
    if _cuda_present():
        return _logged("triton", "a CUDA device is present")
    if interpreting():
        return _logged("triton", "TRITON_INTERPRET=1, the kernels run in the CPU interpreter")
    return _logged("torch", "no CUDA device and TRITON_INTERPRET is not set")


@functools.cache
def _logged(backend: str, why: str) -> str:
    log.info("token-dispatch kernels use the %s path (%s)", backend, why)
    return backend


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether to launch the kernels on this tensor; compiled kernels need CUDA memory."""
    if kernel_backend() != "triton":
        return False
    if tensor.is_cuda or interpreting():
        return True
    _logged("torch", "CPU tensors take the torch reference; TRITON_INTERPRET=1 at import interprets the kernels")
    return False
