"""Each fault injector produces the effect it claims, seen through the Kubernetes API, and
the real controllers react to it as they would on a cloud cluster."""
import pytest
from kubernetes import client

from testcluster import faults
from testcluster.kube import node_ready_status, wait_gone, wait_pod_phase
from testcluster.nodepools import load_pools
from testcluster.waits import wait_until

pytestmark = pytest.mark.cluster

# What kube-controller-manager's node lifecycle controller puts on a NotReady node.
NOT_READY_TAINT = "node.kubernetes.io/not-ready"


def taints_of(core, name):
    return {t.key: t for t in core.read_node(name).spec.taints or []}


def pod_on(node: str, name: str = "victim") -> dict:
    """A pod pinned to ``node`` that tolerates everything the pools taint with."""
    return {
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}],
            "tolerations": [{"operator": "Exists", "effect": "NoSchedule"}],
        },
    }


def test_delete_node_removes_it(cluster, scratch_nodes):
    [[node]] = scratch_nodes("gpu-spot").values()

    faults.delete_node(cluster.core, node)

    wait_gone(lambda: cluster.core.read_node(node), timeout=10, what=f"node {node} to be deleted")


@pytest.mark.parametrize("style", sorted(faults.SPOT_NOTICES))
def test_spot_notice_taints_the_node_like_the_cloud_tool(cluster, scratch_nodes, style):
    core = cluster.core
    [[node]] = scratch_nodes("gpu-spot").values()
    pool_taints = set(taints_of(core, node))

    faults.spot_notice(core, node, style)

    notice = faults.SPOT_NOTICES[style]
    taints = taints_of(core, node)
    assert taints[notice.taint_key].effect == notice.effect
    assert pool_taints <= set(taints), "the notice must not drop the pool's own taints"
    assert bool(core.read_node(node).spec.unschedulable) == notice.cordons
    # The node still runs until the notice period ends.
    assert node_ready_status(core.read_node(node)) == "True"


def test_not_ready_node_is_tainted_by_the_node_lifecycle_controller(cluster, scratch_nodes):
    core = cluster.core
    [[node]] = scratch_nodes("gpu-spot").values()

    faults.make_not_ready(core, node)

    wait_until(lambda: node_ready_status(core.read_node(node)) == "False",
               timeout=30, what=f"node {node} to report Ready=False")
    wait_until(lambda: NOT_READY_TAINT in taints_of(core, node), timeout=60,
               what=f"kube-controller-manager to taint {node} {NOT_READY_TAINT}",
               describe=lambda: str(sorted(taints_of(core, node))))


def test_evict_pod_goes_through_the_eviction_api(cluster, namespace, scratch_nodes):
    core = cluster.core
    [[node]] = scratch_nodes("gpu-spot").values()
    core.create_namespaced_pod(namespace, pod_on(node))
    wait_pod_phase(core, namespace, "victim", "Running", timeout=30)
    client.PolicyV1Api(cluster.api).create_namespaced_pod_disruption_budget(namespace, {
        "metadata": {"name": "keep-victim"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "victim"}}},
    })

    # Refused whether or not the disruption controller has counted the pod yet.
    with pytest.raises(client.ApiException) as refused:
        faults.evict_pod(core, namespace, "victim")
    assert refused.value.status == 429
    client.PolicyV1Api(cluster.api).delete_namespaced_pod_disruption_budget("keep-victim", namespace)

    faults.evict_pod(core, namespace, "victim")

    wait_gone(lambda: core.read_namespaced_pod("victim", namespace), timeout=30, what="the evicted pod to go")


def test_zone_down_takes_down_every_node_of_the_zone_and_only_those(cluster, scratch_nodes):
    core = cluster.core
    (down_zone, down_nodes), (_, other_nodes) = scratch_nodes("gpu-spot", num_zones=2, nodes_per_zone=2).items()

    assert sorted(faults.zone_down(core, down_zone)) == sorted(down_nodes)

    for node in down_nodes:
        wait_until(lambda node=node: node_ready_status(core.read_node(node)) == "False",
                   timeout=30, what=f"node {node} in the downed zone to report Ready=False")
    assert all(node_ready_status(core.read_node(n)) == "True" for n in other_nodes)


def test_zone_down_with_delete_removes_the_zone(cluster, scratch_nodes):
    core = cluster.core
    [(zone, nodes)] = scratch_nodes("gpu-spot", nodes_per_zone=2).items()

    faults.zone_down(core, zone, delete=True)

    for node in nodes:
        wait_gone(lambda node=node: core.read_node(node), timeout=10, what=f"node {node} to be deleted")


def test_heal_undoes_not_ready_and_spot_notice(cluster, scratch_nodes):
    core = cluster.core
    [[node]] = scratch_nodes("gpu-spot").values()
    # The pool's taints as the node was built: read from the node, they may still hold the
    # not-ready taint the lifecycle controller puts on every new node (on a loaded machine
    # it outlived the node's first Ready).
    pool_taints = {t["key"] for t in load_pools().pool("gpu-spot").taints}
    faults.spot_notice(core, node, "aws")
    faults.make_not_ready(core, node)
    wait_until(lambda: NOT_READY_TAINT in taints_of(core, node), timeout=60,
               what=f"kube-controller-manager to taint {node} {NOT_READY_TAINT}")

    faults.heal_node(core, node)

    wait_until(lambda: node_ready_status(core.read_node(node)) == "True",
               timeout=30, what=f"node {node} to report Ready again")
    wait_until(lambda: set(taints_of(core, node)) == pool_taints, timeout=60,
               what=f"node {node} to carry only its pool's taints again",
               describe=lambda: str(sorted(taints_of(core, node))))
    assert not core.read_node(node).spec.unschedulable
