"""The local cluster is reused while it runs, comes back after a stop or a teardown, and never
rebuilds its cached binaries."""
import os
import subprocess

import pytest
from kubernetes import client

from testcluster import local
from testcluster.kube import api_client
from testcluster.nodepools import build_nodes, load_pools

pytestmark = pytest.mark.cluster

# Its own cluster, so tearing it down does not pull the shared cluster from under the other
# tests, nor from under another test session running at the same time.
RESTART_CLUSTER = f"lazarus-restart-test-{os.getpid()}"


def test_up_reuses_the_running_cluster(cluster):
    if not cluster.local:
        pytest.skip("only the local cluster is started by hack/cluster.sh")

    kubeconfig, log = local.up()

    assert kubeconfig == cluster.kubeconfig
    assert "reusing the running cluster" in log
    assert "building" not in log


def test_stop_teardown_and_restart_reuse_the_cached_binaries(cluster):
    if not cluster.local:
        pytest.skip("only the local cluster is started by hack/cluster.sh")
    before = local.cached_binaries()
    expected_nodes = {n["metadata"]["name"] for n in build_nodes(load_pools())}

    def up(expected_log):
        kubeconfig, log = local.up(RESTART_CLUSTER)
        assert expected_log in log
        assert "building" not in log, f"a binary was rebuilt: {log}"
        nodes = client.CoreV1Api(api_client(kubeconfig)).list_node().items
        assert {n.metadata.name for n in nodes} == expected_nodes

    try:
        up("creating the cluster")
        local.stop(RESTART_CLUSTER)
        assert not local.is_running(RESTART_CLUSTER), "still serving after stop"
        up("starting the stopped cluster")
        local.down(RESTART_CLUSTER)
        assert not local.is_running(RESTART_CLUSTER), "still serving after down"
        up("creating the cluster")
    finally:
        local.down(RESTART_CLUSTER)
    assert local.cached_binaries() == before, "a cached binary was rebuilt or changed"


def test_env_gives_subprocesses_the_cluster_and_its_tools(cluster):
    result = subprocess.run(["kubectl", "get", "nodes", "-o", "name"], env=cluster.env(),
                            capture_output=True, text=True, timeout=30)

    assert result.returncode == 0, result.stderr
    assert {n.metadata.name for n in cluster.core.list_node().items} == {
        line.removeprefix("node/") for line in result.stdout.split()
    }
    helm = subprocess.run(["helm", "version", "--short"], env=cluster.env(), capture_output=True, text=True, timeout=30)
    assert helm.returncode == 0 and helm.stdout.startswith("v3."), helm.stderr
