"""Least privilege, proven by requests the real API server refuses: a worker cannot patch a
pod, a job's coordinator cannot touch another job's ConfigMap (or any Secret), and an
operator installed for some namespaces cannot create pods in kube-system."""
import subprocess
import uuid

import pytest
from kubernetes import client

from jobkit import make_job, tool
from testcluster.kube import status_of
from testcluster.waits import wait_until

pytestmark = pytest.mark.cluster

CHART = "helm/lazarus"


def test_a_coordinator_reaches_its_own_jobs_plan_and_state_and_nothing_else(cluster, operator, jobs,
                                                                   namespace, scratch_nodes):
    scratch_nodes("gpu-spot", num_zones=1, nodes_per_zone=2)
    for job in ("a", "b"):
        jobs.create(make_job(job, namespace, maxNodes=2, replicas=2))
    for job in ("a", "b"):
        jobs.wait_generation(job, 1)
    as_a = client.CoreV1Api(cluster.api_as(f"system:serviceaccount:{namespace}:a-coordinator"))
    # The authorizer learns of new bindings through a watch, a moment later.
    wait_until(lambda: status_of(lambda: as_a.read_namespaced_config_map("a-plan", namespace))
               == 200, timeout=15, what="a-coordinator's Role to take effect")
    # Its own plan: read, and watched by name (the coordinator's PlanFollower).
    assert status_of(lambda: as_a.list_namespaced_config_map(
        namespace, field_selector="metadata.name=a-plan")) == 200
    # Another job's: neither read nor written.
    assert status_of(lambda: as_a.read_namespaced_config_map("b-plan", namespace)) == 403
    assert status_of(lambda: as_a.patch_namespaced_config_map(
        "b-plan", namespace, {"data": {"plan.json": "{}"}})) == 403
    assert status_of(lambda: as_a.list_namespaced_config_map(namespace)) == 403
    # Its own job's state: read and written (progress, lost workers); another job's: not.
    assert status_of(lambda: as_a.read_namespaced_config_map("a-state", namespace)) == 200
    assert status_of(lambda: as_a.patch_namespaced_config_map(
        "a-state", namespace, {"data": {}})) == 200
    for verb in (lambda: as_a.read_namespaced_config_map("b-state", namespace),
                 lambda: as_a.patch_namespaced_config_map("b-state", namespace, {"data": {}}),
                 lambda: as_a.delete_namespaced_config_map("b-state", namespace)):
        assert status_of(verb) == 403
    # Nor its own plan written, nor any Secret read (its own job's key included).
    assert status_of(lambda: as_a.patch_namespaced_config_map(
        "a-plan", namespace, {"data": {"plan.json": "{}"}})) == 403
    key_secret = jobs.status("a")["keySecret"]
    assert status_of(lambda: as_a.read_namespaced_secret(key_secret, namespace)) == 403
    assert status_of(lambda: as_a.list_namespaced_secret(namespace)) == 403
    assert status_of(lambda: as_a.create_namespaced_pod(namespace, {
        "metadata": {"name": "x"}, "spec": {"containers": [{"name": "c", "image": "x"}]}})) == 403
    # No pod rights at all: its progress goes to the state ConfigMap.
    worker = jobs.workers("b")[0].metadata.name
    assert status_of(lambda: as_a.patch_namespaced_pod(worker, namespace, {
        "metadata": {"annotations": {"x": "y"}}})) == 403


def test_workers_mount_no_token_and_their_account_cannot_patch_a_pod(cluster, operator, jobs,
                                                                      namespace,
                                                                      scratch_nodes):
    scratch_nodes("gpu-spot", num_zones=1, nodes_per_zone=2)
    jobs.create(make_job("w", namespace, maxNodes=2, replicas=2))
    workers = wait_until(lambda: len(w := jobs.workers("w")) == 2 and w, timeout=30,
                         what="2 workers")
    for pod in workers:
        assert pod.spec.automount_service_account_token is False
    account = workers[0].spec.service_account_name or "default"
    as_worker = client.CoreV1Api(cluster.api_as(f"system:serviceaccount:{namespace}:{account}"))
    target = workers[1].metadata.name
    assert status_of(lambda: as_worker.patch_namespaced_pod(target, namespace, {
        "spec": {"containers": [{"name": "worker", "image": "evil:latest"}]}})) == 403
    assert status_of(lambda: as_worker.patch_namespaced_pod(target, namespace, {
        "metadata": {"annotations": {"lazarus.dev/progress": "{}"}}})) == 403
    assert status_of(lambda: as_worker.list_namespaced_secret(namespace)) == 403


def test_a_namespaced_operator_cannot_create_pods_in_kube_system(cluster, namespace):
    """The chart's RBAC with operator.allNamespaces=false, as the operator's account sees it."""
    helm = tool("helm")
    if helm is None:
        pytest.skip("helm is not cached; hack/build-control-plane.sh builds it")
    release = f"lp-{uuid.uuid4().hex[:6]}"
    rendered = subprocess.run(
        [str(helm), "template", release, CHART, "--namespace", namespace,
         "--set", "operator.allNamespaces=false", "--set", f"operator.namespaces={{{namespace}}}",
         "--show-only", "templates/rbac-operator.yaml",
         "--show-only", "templates/serviceaccount.yaml"],
        capture_output=True, text=True, check=True, timeout=60).stdout
    kubectl = tool("kubectl")
    apply = subprocess.run([str(kubectl), f"--kubeconfig={cluster.kubeconfig}", "apply", "-f", "-"],
                           input=rendered, capture_output=True, text=True, timeout=60)
    assert apply.returncode == 0, apply.stderr
    try:
        as_operator = client.CoreV1Api(cluster.api_as(
            f"system:serviceaccount:{namespace}:{release}-operator"))
        pod = {"metadata": {"name": "probe"},
               "spec": {"containers": [{"name": "c", "image": "busybox"}]}}
        # Allowed where it manages jobs (a dry run: nothing is made) ...
        wait_until(lambda: status_of(lambda: as_operator.create_namespaced_pod(
            namespace, pod, dry_run="All")) == 200, timeout=15,
            what="the operator's RoleBinding to take effect")
        # ... and nowhere else.
        assert status_of(lambda: as_operator.create_namespaced_pod(
            "kube-system", pod, dry_run="All")) == 403
        assert status_of(lambda: as_operator.create_namespaced_config_map(
            "kube-system", {"metadata": {"name": "probe"}}, dry_run="All")) == 403
        assert status_of(lambda: as_operator.list_namespaced_secret(namespace)) == 403
        assert status_of(lambda: as_operator.list_node()) == 200  # read-only, cluster-wide
    finally:
        subprocess.run([str(kubectl), f"--kubeconfig={cluster.kubeconfig}", "delete",
                        "--ignore-not-found", "-f", "-"], input=rendered, capture_output=True,
                       text=True, timeout=60)
