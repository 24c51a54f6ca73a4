"""Prepare the Triton kernels for the CPU interpreter without turning it on for other tests.

Triton chooses interpreter or compiler when a kernel is decorated, at import, so the kernels
are imported here, before any test module, with TRITON_INTERPRET=1. The variable is restored
at once: other tests' ops on CPU keep the fast torch reference, and test_dispatch_kernels turns
the interpreter on for its own tests.

Also here: ``one_thread``, for tests that train in the pytest process.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    _saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    import lazarus_runtime.kernels  # noqa: F401

    if _saved is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _saved


@pytest.fixture
def one_thread():
    """One intra-op thread, for tests that train in the pytest process: the tiny models gain
    nothing from more, and on a shared 2-core machine a second thread waiting for a busy
    core makes every op 10-40x slower."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
