"""Test support for a real Kubernetes API server: the local cluster, simulated node pools,
fault injectors and bounded waits. Shared by tests/cluster and the operator e2e tests.

tests/conftest.py puts tests/ on sys.path, so this package imports as ``testcluster``; the
shell reaches it through hack/cluster.sh and hack/fault.sh.
"""
