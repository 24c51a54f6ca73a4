"""The local cluster is reused while it runs, comes back after a teardown, and never rebuilds
its cached binaries."""
import pytest
from kubernetes import client

from testcluster import local
from testcluster.kube import api_client
from testcluster.nodepools import build_nodes, load_pools

pytestmark = pytest.mark.cluster

# Its own cluster, so tearing it down does not pull the session's cluster from under the
# other tests.
RESTART_CLUSTER = "lazarus-restart-test"


def test_up_reuses_the_running_cluster(cluster):
    if not cluster.local:
        pytest.skip("only the local cluster is started by hack/cluster.sh")

    kubeconfig, log = local.up()

    assert kubeconfig == cluster.kubeconfig
    assert "reusing the running cluster" in log
    assert "building" not in log


def test_teardown_and_restart_reuse_the_cached_binaries(cluster):
    if not cluster.local:
        pytest.skip("only the local cluster is started by hack/cluster.sh")
    before = local.cached_binaries()
    expected_nodes = {n["metadata"]["name"] for n in build_nodes(load_pools())}
    local.down(RESTART_CLUSTER)  # left over from an interrupted run
    try:
        for attempt in ("first start", "start after teardown"):
            kubeconfig, log = local.up(RESTART_CLUSTER)
            assert "creating the cluster" in log, f"{attempt}: {log}"
            assert "building" not in log, f"{attempt} rebuilt a binary: {log}"
            nodes = client.CoreV1Api(api_client(kubeconfig)).list_node().items
            assert {n.metadata.name for n in nodes} == expected_nodes, attempt
            local.down(RESTART_CLUSTER)
            assert not local.is_running(RESTART_CLUSTER), f"{attempt}: still serving after down"
    finally:
        local.down(RESTART_CLUSTER)
    assert local.cached_binaries() == before, "a cached binary was rebuilt or changed"
