"""Fixtures every test folder shares: a real Kubernetes cluster (see tests/testcluster)."""
import sys
from pathlib import Path

import pytest

# tests/testcluster imports as `testcluster` under any pytest import mode.
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from testcluster.fixtures import (  # noqa: E402,F401
    cluster,
    namespace,
    pytest_runtest_makereport,
    scratch_nodes,
)
from testcluster.images import images  # noqa: E402,F401
from testcluster.kubelet import container_kubelet, local_kubelet  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
    """A test marked ``gpu`` is skipped where torch sees no CUDA device (CI runs on CPUs)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch  # only when GPU tests are collected: the operator tiers need no torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; hack/gpu-check.sh runs it on one")
    for item in gpu_items:
        item.add_marker(skip)
from testcluster.s3server import s3_bucket, s3_server  # noqa: E402,F401
