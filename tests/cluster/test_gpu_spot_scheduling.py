"""The real kube-scheduler places GPU pods on the simulated pools by their labels, taints and
nvidia.com/gpu capacity, as it would on a cloud cluster.

The pods ask for one GPU, so they still fit when other tests share the cluster's GPUs."""
import pytest

from testcluster.kube import pod_scheduling_message, wait_pod_phase
from testcluster.nodepools import GPU_RESOURCE, POOL_LABEL
from testcluster.waits import wait_until

pytestmark = pytest.mark.cluster

SPOT_TOLERATIONS = [
    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"},
]
GPU_TOLERATIONS = SPOT_TOLERATIONS[:1]


def gpu_pod(name: str, num_gpus: int, *, node_selector: dict | None = None, tolerations=()) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [{
                "name": "worker",
                "image": "registry.k8s.io/pause:3.10",
                "resources": {"limits": {GPU_RESOURCE: str(num_gpus)}},
            }],
            "nodeSelector": node_selector or {},
            "tolerations": list(tolerations),
        },
    }


def test_spot_gpu_pod_is_bound_to_a_spot_node_and_runs(cluster, namespace):
    core = cluster.core
    core.create_namespaced_pod(namespace, gpu_pod(
        "trainer", 1, node_selector={"karpenter.sh/capacity-type": "spot"}, tolerations=SPOT_TOLERATIONS,
    ))

    pod = wait_pod_phase(core, namespace, "trainer", "Running", timeout=60)

    node = core.read_node(pod.spec.node_name)
    assert node.metadata.labels["karpenter.sh/capacity-type"] == "spot"
    assert node.metadata.labels["cloud.google.com/gke-spot"] == "true"
    assert node.metadata.labels[POOL_LABEL] == "gpu-spot"
    scheduled = [e for e in core.list_namespaced_event(namespace).items if e.reason == "Scheduled"]
    assert scheduled, "no Scheduled event: the pod was not bound by kube-scheduler"
    assert "default-scheduler" in (scheduled[0].reporting_component or scheduled[0].source.component or "")


def test_gpu_pod_without_spot_toleration_lands_on_demand(cluster, namespace):
    core = cluster.core
    core.create_namespaced_pod(namespace, gpu_pod("trainer", 1, tolerations=GPU_TOLERATIONS))

    pod = wait_pod_phase(core, namespace, "trainer", "Running", timeout=60)

    node = core.read_node(pod.spec.node_name)
    assert node.metadata.labels["karpenter.sh/capacity-type"] == "on-demand"


def test_pod_asking_for_more_gpus_than_any_node_has_stays_pending(cluster, namespace):
    core = cluster.core
    most_gpus = max(int((n.status.allocatable or {}).get(GPU_RESOURCE, "0")) for n in core.list_node().items)
    assert most_gpus > 0, "no node advertises nvidia.com/gpu"
    core.create_namespaced_pod(namespace, gpu_pod(
        "too-big", most_gpus + 1, node_selector={"karpenter.sh/capacity-type": "spot"},
        tolerations=SPOT_TOLERATIONS,
    ))

    message = wait_until(
        lambda: pod_scheduling_message(core.read_namespaced_pod("too-big", namespace)),
        timeout=30, what="the scheduler to report why too-big cannot be placed",
    )

    assert message.startswith("Unschedulable:")
    assert f"Insufficient {GPU_RESOURCE}" in message
    pod = core.read_namespaced_pod("too-big", namespace)
    assert pod.status.phase == "Pending"
    assert pod.spec.node_name is None
