"""Owners, not labels: the operator takes an object for a job's own only when the job owns it
(by UID). Labels can be copied by anyone who may create a pod or a Service in the namespace.
"""
import pytest
from lazarus_core.cluster_contract import API_VERSION, state_configmap_data
from lazarus_core.controller import Progress

from jobkit import make_job, settle
from testcluster.waits import wait_until

pytestmark = pytest.mark.cluster


def _squat_service(core, namespace, name, job):
    core.create_namespaced_service(namespace, {
        "metadata": {"name": name, "labels": {"lazarus.dev/job": job}},
        "spec": {"selector": {"app": "not-lazarus"}, "ports": [{"port": 80}]}})


def _squat_configmap(core, namespace, name, job):
    core.create_namespaced_config_map(namespace, {
        "metadata": {"name": name, "labels": {"lazarus.dev/job": job, "lazarus.dev/role": "plan"}},
        "data": {"plan.json": "{}"}})


@pytest.mark.parametrize("kind, name, squat, remove", [
    ("Service", "taken-coordinator", _squat_service, "delete_namespaced_service"),
    ("ConfigMap", "taken-plan", _squat_configmap, "delete_namespaced_config_map"),
    ("ConfigMap", "taken-state", _squat_configmap, "delete_namespaced_config_map"),
])
def test_a_name_taken_by_an_object_that_is_not_the_jobs_gets_a_condition(
        cluster, operator, jobs, namespace, scratch_nodes, kind, name, squat, remove):
    scratch_nodes("gpu-spot", num_zones=1, nodes_per_zone=2)
    squat(cluster.core, namespace, name, "taken")
    jobs.create(make_job("taken", namespace, maxNodes=2, replicas=2))

    cond = wait_until(lambda: (c := jobs.condition("taken", "Ready")) and
                      c["reason"] == "NameConflict" and c, timeout=10,
                      what="the NameConflict condition")
    assert f"{kind} named {name}" in cond["message"] and "delete it" in cond["message"]
    settle(3)
    # Not adopted, not overwritten, and nothing of the job runs meanwhile.
    read = getattr(cluster.core, remove.replace("delete_", "read_"))
    assert read(name, namespace).metadata.owner_references is None
    pods = cluster.core.list_namespaced_pod(namespace, label_selector="lazarus.dev/job=taken")
    assert pods.items == []
    assert any(e.reason == "NameConflict" for e in jobs.events("taken"))

    getattr(cluster.core, remove)(name, namespace)  # the name is free: the job starts
    jobs.wait_generation("taken", 1)
    assert jobs.condition("taken", "Ready")["reason"] != "NameConflict"


def test_pods_and_configmaps_labelled_as_the_jobs_but_not_its_own_cannot_steer_it(
        cluster, operator, jobs, namespace, scratch_nodes):
    """The review's attack, and its variants since progress moved to the job's state
    ConfigMap: a pod with the worker labels, a running one with the coordinator labels, and
    a ConfigMap with the state labels (naming the job as its owner, by the
    UID anyone who may read the job can copy) saying the job of 5 steps is done. Before
    owners counted, each would have counted as the job's own."""
    [(_, nodes)] = scratch_nodes("gpu-spot", num_zones=1, nodes_per_zone=3).items()
    jobs.create(make_job("victim", namespace, maxNodes=2, replicas=2, steps=5))
    jobs.wait_generation("victim", 1)
    uid = jobs.get("victim")["metadata"]["uid"]
    for name, role, index in (("victim-worker-99", "worker", "99"),
                              ("victim-coordinator-99", "coordinator", "99")):
        cluster.core.create_namespaced_pod(namespace, {
            "metadata": {"name": name, "labels": {"lazarus.dev/job": "victim",
                                                  "lazarus.dev/role": role,
                                                  "lazarus.dev/index": index}},
            "spec": {"nodeName": nodes[2], "containers": [{"name": "c", "image": "x"}],
                     "tolerations": [{"operator": "Exists"}], "restartPolicy": "Never"}})
    forged = Progress(step=5, generation=1, loads=None, checkpoint_step=None)
    cluster.core.create_namespaced_config_map(namespace, {
        "metadata": {"name": "victim-state-forged",
                     "labels": {"lazarus.dev/job": "victim", "lazarus.dev/role": "state"},
                     "ownerReferences": [{"apiVersion": API_VERSION,
                                          "kind": "LazarusJob", "name": "victim", "uid": uid}]},
        "data": state_configmap_data(forged, {})})
    wait_until(lambda: cluster.core.read_namespaced_pod("victim-worker-99", namespace)
               .status.phase == "Running", timeout=20, what="the forged pod to run")
    settle(3)
    status = jobs.status("victim")
    assert status.get("step", 0) == 0 and status["readyNodes"] == 2
    assert jobs.condition("victim", "Ready")["reason"] != "Succeeded"
    # Not the job's to count, nor to delete; the real coordinator runs beside the fake one.
    for fake in ("victim-worker-99", "victim-coordinator-99"):
        assert cluster.core.read_namespaced_pod(fake, namespace).metadata.deletion_timestamp is None
    coordinators = cluster.core.list_namespaced_pod(
        namespace, label_selector="lazarus.dev/job=victim,lazarus.dev/role=coordinator").items
    assert any(p.metadata.owner_references and p.metadata.owner_references[0].uid == uid
               for p in coordinators)
