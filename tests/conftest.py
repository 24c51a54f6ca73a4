"""Fixtures every test folder shares: a real Kubernetes cluster (see tests/testcluster)."""
import sys
from pathlib import Path

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
