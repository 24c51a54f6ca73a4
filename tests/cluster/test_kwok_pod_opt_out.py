"""kwok leaves pods labelled lazarus.dev/kubelet to whoever plays their kubelet (the full e2e
tests run their commands as local processes): the scheduler binds them, but kwok neither
marks them Running nor finishes their deletion."""
import time

import pytest

from testcluster.kube import wait_gone, wait_pod_phase
from testcluster.waits import wait_until

pytestmark = pytest.mark.cluster

OPT_OUT_LABEL = "lazarus.dev/kubelet"


def pod(name: str, labels: dict) -> dict:
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "nodeSelector": {"lazarus.dev/pool": "system"},
            "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}],
        },
    }


def test_labelled_pod_is_bound_but_left_alone(cluster, namespace):
    if not cluster.local:
        pytest.skip("only the local cluster runs kwok")
    core = cluster.core
    core.create_namespaced_pod(namespace, pod("local", {OPT_OUT_LABEL: "local"}))
    try:
        core.create_namespaced_pod(namespace, pod("simulated", {}))

        wait_pod_phase(core, namespace, "simulated", "Running", timeout=30)
        bound = wait_until(lambda: core.read_namespaced_pod("local", namespace).spec.node_name,
                           timeout=30, what="the scheduler to bind the opted-out pod")
        time.sleep(2)  # kwok marked the other pod Running by now; give it the same chance here
        assert bound and core.read_namespaced_pod("local", namespace).status.phase == "Pending"

        core.delete_namespaced_pod("local", namespace)
        time.sleep(2)
        assert core.read_namespaced_pod("local", namespace).metadata.deletion_timestamp is not None, \
            "kwok finished deleting a pod it should have left to its own kubelet"
    finally:
        # Nobody plays this pod's kubelet: without a forced delete it would stay Terminating.
        core.delete_namespaced_pod("local", namespace, grace_period_seconds=0)
    wait_gone(lambda: core.read_namespaced_pod("local", namespace), timeout=10, what="the force-deleted pod to go")
