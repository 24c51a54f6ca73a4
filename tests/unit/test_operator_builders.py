"""The operator's pure parts: the manifests it builds and how it reads pods and nodes."""
import json

import pytest

pytest.importorskip("kopf")  # the operator extra

from lazarus_core import process_env as penv  # noqa: E402
from lazarus_core.cluster_contract import (ExitReport, exit_of,  # noqa: E402
                                           exit_reason, read_plan_configmap,
                                           read_state_configmap, state_configmap_data)
from lazarus_core.controller import Progress  # noqa: E402
from lazarus_core.job_spec import parse_spec  # noqa: E402
from lazarus_core.solver import plan_job  # noqa: E402
from lazarus_core.topology import NodeSpec  # noqa: E402
from lazarus_operator import builders  # noqa: E402
from lazarus_operator.observe import (NodeInfo, observe_coordinator,  # noqa: E402
                                     observe_workers)

SPEC = parse_spec({
    "runtime": {"model": "tiny", "experts": 4, "layers": 2},
    "minNodes": 2, "maxNodes": 4, "gpusPerNode": 2, "slotsPerGpu": 2,
    "checkpoint": {"path": "s3://bucket/ckpt", "everySteps": 10, "keep": 4,
                   "secretName": "ckpt-creds"},
    "spotNoticeTaints": [{"key": "karpenter.sh/disrupted"}],
    "coordinator": {"nodeSelector": {"pool": "cpu"}},
    "template": {"image": "img:1", "nodeSelector": {"pool": "gpu"}, "serviceAccountName": "sa",
                 "labels": {"team": "moe", "lazarus.dev/role": "not-mine"},
                 "resources": {"limits": {"nvidia.com/gpu": 2}},
                 "tolerations": [{"key": "spot", "operator": "Exists"}],
                 "env": [{"name": "EXTRA", "value": "1"},
                         {"name": penv.JOB, "value": "cannot override"}]},
})


KEY = penv.new_job_key()
KEY_SECRET = "j-key-x7k2p"


def _environment(container: dict, node: str = "node-7") -> dict[str, str]:
    """The variables the process sees, as the kubelet fills them in: the downward API's node
    name, and the job's key from its Secret."""
    seen = {}
    for e in container["env"]:
        ref = e.get("valueFrom", {})
        if "secretKeyRef" in ref:
            assert ref["secretKeyRef"] == {"name": KEY_SECRET, "key": builders.KEY_SECRET_ENTRY}
            seen[e["name"]] = KEY
        else:
            seen[e["name"]] = e.get("value", node)
    return seen


def test_worker_pod_carries_the_plan_location_and_secure_defaults():
    pod = builders.build_worker_pod("j", "ns", SPEC, 3, generation=7, key_secret=KEY_SECRET,
                                    job_uid="uid-1")
    assert pod["metadata"]["name"] == "j-worker-3"
    assert pod["metadata"]["annotations"][builders.GENERATION_ANNOTATION] == "7"
    c = pod["spec"]["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert env[penv.PLAN_CONFIGMAP]["value"] == "j-plan"
    assert env[penv.JOB]["value"] == "j"  # the template cannot redirect a worker
    assert env["EXTRA"]["value"] == "1"
    assert env[penv.NODE_NAME]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # What the worker reads from it.
    worker = penv.read_worker_env(_environment(c))
    assert (worker.job, worker.key) == ("j", KEY)
    assert worker.coordinator_address == ("j-coordinator.ns.svc", 29400)
    assert (worker.node, worker.runtime["model"]) == ("node-7", "tiny")
    assert (worker.checkpoint_path, worker.checkpoint_every_steps, worker.checkpoint_keep,
            worker.job_uid) == ("s3://bucket/ckpt", 10, 4, "uid-1")
    # Credentials come from the Secret the spec names, never as values in the manifest.
    assert c["envFrom"] == [{"secretRef": {"name": "ckpt-creds"}}]
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert pod["metadata"]["labels"]["team"] == "moe"  # the template's labels ride along,
    assert pod["metadata"]["labels"]["lazarus.dev/role"] == "worker"  # never over ours
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"  # a Quantity string
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    scratch = {v["name"]: v for v in pod["spec"]["volumes"]}[builders.SCRATCH_VOLUME]
    assert "emptyDir" in scratch and {"name": builders.SCRATCH_VOLUME, "mountPath": "/tmp"} in c[
        "volumeMounts"]
    # The job gave its workers an account (e.g. for checkpoint storage): they mount it.
    assert pod["spec"]["automountServiceAccountToken"] is True
    assert pod["spec"]["serviceAccountName"] == "sa"
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["nodeSelector"] == {"pool": "gpu"}
    anti = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"


def test_coordinator_pod_runs_on_regular_capacity_and_its_service_selects_only_it():
    pod = builders.build_coordinator_pod("j", "ns", SPEC, KEY_SECRET, index=3, port=1234,
                                         job_uid="uid-1")
    svc = builders.build_coordinator_service("j", "ns", port=1234)
    c = pod["spec"]["containers"][0]
    env = _environment(c)
    assert (pod["metadata"]["name"], svc["metadata"]["name"]) == ("j-coordinator-3", "j-coordinator")
    assert c["command"][-1] == "lazarus_runtime.cluster_coordinator"
    coordinator = penv.read_coordinator_env(env)
    assert (coordinator.job, coordinator.plan_configmap, coordinator.state_configmap,
            coordinator.port) == ("j", "j-plan", "j-state", 1234)
    assert coordinator.steps is None  # trains until deleted
    assert coordinator.key == KEY
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": builders.SCRATCH_VOLUME, "mountPath": "/tmp"} in c["volumeMounts"]
    # It chooses the checkpoint to restore, so it reads the job's checkpoints too.
    assert (coordinator.checkpoint_path, coordinator.job_uid) == ("s3://bucket/ckpt", "uid-1")
    assert c["envFrom"] == [{"secretRef": {"name": "ckpt-creds"}}]
    assert env["EXTRA"] == "1"
    # spec.coordinator places it; none of the workers' GPU request, selector or tolerations.
    assert pod["spec"]["nodeSelector"] == {"pool": "cpu"} and pod["spec"]["tolerations"] == []
    # Kept off spot capacity however a cloud labels it, on top of spec.coordinator.
    terms = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    rules = {(m["key"], m["operator"], tuple(m["values"])) for m in terms[0]["matchExpressions"]}
    assert ("karpenter.sh/capacity-type", "NotIn", ("spot",)) in rules
    assert ("cloud.google.com/gke-spot", "NotIn", ("true",)) in rules
    pdb = builders.build_coordinator_pdb("j", "ns")
    assert pdb["spec"]["minAvailable"] == 1
    assert all(pod["metadata"]["labels"][k] == v
               for k, v in pdb["spec"]["selector"]["matchLabels"].items())
    assert "nvidia.com/gpu" not in json.dumps(c["resources"])
    assert c["resources"]["limits"]["memory"] == "2Gi"  # bounded, unless spec.coordinator says
    # Its own account, whatever the template says (that one is the workers').
    assert pod["spec"]["serviceAccountName"] == "j-coordinator"
    assert pod["spec"]["automountServiceAccountToken"] is True
    assert pod["metadata"]["labels"]["team"] == "moe"
    selected = svc["spec"]["selector"]
    assert all(pod["metadata"]["labels"][k] == v for k, v in selected.items())
    worker = builders.build_worker_pod("j", "ns", SPEC, 0, generation=1, key_secret=KEY_SECRET,
                                       job_uid="uid-1")
    assert not all(worker["metadata"]["labels"].get(k) == v for k, v in selected.items())
    assert svc["spec"]["ports"][0]["port"] == 1234
    finite = builders.build_coordinator_pod("j", "ns", parse_spec(
        {"runtime": {"experts": 4, "layers": 2}, "minNodes": 2, "maxNodes": 4,
         "slotsPerGpu": 4, "steps": 300}), KEY_SECRET, job_uid="uid-1")
    assert penv.read_coordinator_env(_environment(finite["spec"]["containers"][0])).steps == 300
    assert "envFrom" not in finite["spec"]["containers"][0]  # no checkpoints, no Secret


def test_workers_mount_no_token_unless_the_job_gives_them_an_account():
    spec = parse_spec({"runtime": {"experts": 4, "layers": 2}, "minNodes": 2, "maxNodes": 4,
                       "slotsPerGpu": 4})
    pod = builders.build_worker_pod("j", "ns", spec, 0, generation=1, key_secret=KEY_SECRET, job_uid="u")
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in pod["spec"]


def test_the_key_secret_is_the_one_the_pods_read():
    secret = builders.build_key_secret("j", "ns", KEY)
    # The API server picks the name: nothing made before the job can pass for it.
    assert "name" not in secret["metadata"] and secret["metadata"]["generateName"] == "j-key-"
    assert secret["stringData"] == {builders.KEY_SECRET_ENTRY: KEY}
    for pod in (builders.build_worker_pod("j", "ns", SPEC, 0, 1, key_secret=KEY_SECRET, job_uid="u"),
                builders.build_coordinator_pod("j", "ns", SPEC, KEY_SECRET, job_uid="u")):
        refs = [e["valueFrom"]["secretKeyRef"] for e in pod["spec"]["containers"][0]["env"]
                if "secretKeyRef" in e.get("valueFrom", {})]
        assert refs == [{"name": KEY_SECRET, "key": builders.KEY_SECRET_ENTRY}]


def test_the_coordinators_role_reaches_only_its_own_jobs_plan_and_state():
    account, role, binding = builders.build_coordinator_access("j", "ns")
    pod = builders.build_coordinator_pod("j", "ns", SPEC, KEY_SECRET, job_uid="u")
    assert account["kind"] == "ServiceAccount"
    assert account["metadata"]["name"] == pod["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "j-coordinator",
                                    "namespace": "ns"}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    configmaps = [r for r in role["rules"] if "configmaps" in r["resources"]]
    assert configmaps == [{"apiGroups": [""], "resources": ["configmaps"],
                           "verbs": ["get", "list", "watch"], "resourceNames": ["j-plan"]},
                          {"apiGroups": [""], "resources": ["configmaps"],
                           "verbs": ["get", "patch"], "resourceNames": ["j-state"]}]
    assert configmaps == role["rules"]  # no pod rights, nothing else
    for rule in role["rules"]:
        assert "secrets" not in rule["resources"] and "*" not in rule["verbs"]
        assert not {"create", "delete", "update"} & set(rule["verbs"])


def test_the_network_policy_admits_only_the_jobs_own_pods():
    policy = builders.build_network_policy("j", "ns")
    selected = policy["spec"]["podSelector"]["matchLabels"]
    for pod in (builders.build_worker_pod("j", "ns", SPEC, 0, 1, key_secret=KEY_SECRET, job_uid="u"),
                builders.build_coordinator_pod("j", "ns", SPEC, KEY_SECRET, job_uid="u")):
        assert selected.items() <= pod["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": selected}}]}]
    other = builders.build_worker_pod("k", "ns", SPEC, 0, 1, key_secret="k-key", job_uid="u")
    assert not selected.items() <= other["metadata"]["labels"].items()


def test_a_process_started_without_its_environment_is_told_what_is_missing():
    with pytest.raises(penv.EnvError, match=penv.NODE_NAME):
        penv.read_worker_env({penv.COORDINATOR: "h:1", penv.RUNTIME: "{}"})
    with pytest.raises(penv.EnvError, match="malformed"):
        penv.read_coordinator_env({penv.JOB: "j", penv.NAMESPACE: "n", penv.JOB_KEY: KEY,
                                   penv.PLAN_CONFIGMAP: "p", penv.STATE_CONFIGMAP: "s",
                                   penv.COORDINATOR_PORT: "x"})
    with pytest.raises(penv.EnvError, match=penv.JOB_KEY):
        penv.read_coordinator_env({penv.JOB: "j", penv.NAMESPACE: "n", penv.JOB_KEY: "short",
                                   penv.PLAN_CONFIGMAP: "p", penv.STATE_CONFIGMAP: "s",
                                   penv.COORDINATOR_PORT: "1"})


def test_plan_configmap_round_trips_the_plan_and_the_draining_nodes():
    nodes = [NodeSpec(f"n{i}", 2, 2) for i in range(3)]
    plan = plan_job(nodes, 4, 2, 2)
    cm = builders.build_plan_configmap("j", "ns", plan)
    assert cm["metadata"]["annotations"][builders.GENERATION_ANNOTATION] == "1"
    assert read_plan_configmap(cm["data"]) == (plan, frozenset())
    drained = builders.build_plan_configmap("j", "ns", plan, draining=("n9", "n7"))
    assert read_plan_configmap(drained["data"]) == (plan, frozenset({"n7", "n9"}))


def test_the_state_configmap_round_trips_progress_and_lost_workers():
    p = Progress(step=12, generation=3, loads=((1, 2), (3, 4)), checkpoint_step=10,
                 experts_migrated=5, restored_step=None, experts_lost=0, restores=2)
    suspects = {"n2": "no heartbeat for 3.1 s"}
    assert read_state_configmap(state_configmap_data(p, suspects)) == (p, suspects)
    assert read_state_configmap({}) == (None, {})
    # Garbage from a buggy coordinator reads as absent, never as an error.
    assert read_state_configmap({"progress.json": '{"step": "x"}',
                                 "suspects.json": "[1]"}) == (None, {})
    cm = builders.build_state_configmap("j", "ns")
    assert cm["metadata"]["name"] == "j-state" and cm["metadata"]["labels"][
        "lazarus.dev/role"] == "state"


def _node(name, ready=True, taints=(), labels=None):
    return {"metadata": {"name": name, "labels": labels or {}},
            "spec": {"taints": [{"key": k, "effect": "NoSchedule"} for k in taints]},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


JOB_UID = "5e2a-job-uid"


def _pod(name, node=None, phase="Running", index=0, deleting=False, conditions=(),
         owner=JOB_UID):
    meta = {"name": name, "labels": {builders.INDEX_LABEL: str(index)}, "annotations": {},
            "ownerReferences": [{"kind": "LazarusJob", "name": "j", "uid": owner}]}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {"nodeName": node} if node else {},
            "status": {"phase": phase, "conditions": list(conditions)}}


def test_observation_sorts_pods_into_live_starting_noticed_and_doomed():
    nodes = {
        "a": NodeInfo.from_manifest(_node("a", labels={"karpenter.sh/capacity-type": "spot",
                                                       "topology.kubernetes.io/zone": "z1"})),
        "b": NodeInfo.from_manifest(_node("b", taints=["karpenter.sh/disrupted"])),
        "c": NodeInfo.from_manifest(_node("c", ready=False)),
        "d": NodeInfo.from_manifest(_node("d")),
        "gone": None,
    }
    pods = [
        _pod("j-worker-0", "a", index=0),
        _pod("j-worker-1", "b", index=1),
        _pod("j-worker-2", "c", index=2),
        _pod("j-worker-3", None, phase="Pending", index=3),
        _pod("j-worker-4", "gone", index=4),
        _pod("j-worker-5", "d", phase="Failed", index=5),  # e.g. evicted
        _pod("j-worker-6", "d", index=6, deleting=True),
        _pod("j-worker-7", "d", index=7,
             conditions=[{"type": "DisruptionTarget", "status": "True"}]),
    ]
    obs = observe_workers(pods, nodes, SPEC, JOB_UID)
    assert [n.name for n in obs.live] == ["a", "b", "d"]
    assert obs.live[0] == NodeSpec("a", 2, 2, "z1", "spot")
    assert obs.noticed == {"b", "d"}
    assert obs.starting == ["j-worker-3"]
    assert obs.doomed == [("j-worker-2", True), ("j-worker-4", True), ("j-worker-5", False)]
    assert obs.used_indices == set(range(8))


def test_ranks_the_coordinator_found_lost_drop_their_gpus_but_their_pods_are_kept():
    nodes = {n: NodeInfo.from_manifest(_node(n)) for n in "abc"}
    pods = [_pod(f"j-worker-{i}", n, index=i) for i, n in enumerate("abc")]
    # Both ranks of b (the node is lost), one of c (its GPU 0 is), and a name no coordinator
    # writes (ignored rather than fatal).
    silent = "no heartbeat for 3.0 s"
    obs = observe_workers(pods, nodes, SPEC, JOB_UID,
                          suspects=dict.fromkeys(("b/0", "b/1", "c/0", "junk"), silent))
    assert [n.name for n in obs.live] == ["a", "c"]
    assert obs.live[0].devices == (0, 1) and obs.live[1].devices == (1,)
    assert obs.live[1].gpus == 1
    assert obs.doomed == [] and set(obs.pod_on) == {"a", "b", "c"}
    assert obs.failed == []  # silent ranks may beat again: not a failure


def test_a_running_pod_whose_every_rank_exited_is_a_failed_worker_already():
    """Its agent ends the pod soon; the coordinator's report of the exits (with the ranks'
    last words) counts now, so that no replacement starts before the failure is known."""
    nodes = {n: NodeInfo.from_manifest(_node(n)) for n in "abcd"}
    pods = [_pod(f"j-worker-{i}", n, index=i) for i, n in enumerate("abcd")]
    for p in pods:
        p["metadata"]["uid"] = f"uid-{p['metadata']['name']}"
    error = "ValueError: dataset: '/data/x.txt' is not an existing file"
    obs = observe_workers(pods, nodes, SPEC, JOB_UID, suspects={
        # Every rank exited:
        "a/0": exit_reason(1, error, "uid-j-worker-0"),
        "a/1": exit_reason(-9, "", "uid-j-worker-0"),
        # One still may beat:
        "b/0": exit_reason(1, error, "uid-j-worker-1"), "b/1": "no heartbeat for 3.0 s",
        # One of two: c only loses a GPU.
        "c/0": exit_reason(1, error, "uid-j-worker-2"),
        # Exits the pod before this one on d reported: this one's ranks are starting.
        "d/0": exit_reason(1, error, "uid-gone"), "d/1": exit_reason(1, error, "uid-gone")})
    assert obs.failed == [("uid-j-worker-0", "a", f"exit status 1: {error}")]
    assert [n.name for n in obs.live] == ["c", "d"] and obs.doomed == []


def test_the_coordinator_is_replaced_when_its_process_pod_or_node_dies():
    nodes = {"a": NodeInfo.from_manifest(_node("a")),
             "sick": NodeInfo.from_manifest(_node("sick", ready=False)), "gone": None}
    running = [_pod("j-coordinator-0", "a", index=0)]
    assert observe_coordinator(running, nodes, JOB_UID).alive
    assert observe_coordinator([_pod("j-coordinator-0", None, "Pending")], nodes, JOB_UID).alive
    done = observe_coordinator([_pod("j-coordinator-0", "a", "Succeeded")], nodes, JOB_UID)
    assert done.finished and not done.alive and done.doomed == []  # the job trained its steps
    for dead, force in ((_pod("j-coordinator-0", "a", "Failed"), False),
                        (_pod("j-coordinator-0", "sick"), True),
                        (_pod("j-coordinator-0", "gone"), True)):
        obs = observe_coordinator([dead], nodes, JOB_UID)
        assert not obs.alive and obs.doomed == [("j-coordinator-0", force)]
        assert obs.next_index == 1  # a new name: no waiting for the old one to be freed
    deleting = observe_coordinator([_pod("j-coordinator-4", "a", index=4, deleting=True)], nodes,
                                   JOB_UID)
    assert not deleting.alive and deleting.doomed == [] and deleting.next_index == 5


def test_a_pod_with_the_jobs_labels_that_the_job_does_not_own_counts_for_nothing():
    """Labels can be copied by anyone who may create a pod; ownership cannot."""
    nodes = {n: NodeInfo.from_manifest(_node(n)) for n in ("a", "b")}
    forged = _pod("j-worker-9", "b", index=9, owner="someone-else")
    obs = observe_workers([_pod("j-worker-0", "a"), forged], nodes, SPEC, JOB_UID)
    assert [n.name for n in obs.live] == ["a"]
    assert obs.doomed == [] and obs.starting == []  # and it is not the job's to delete
    assert obs.used_indices == {0, 9}  # its name is never reused, though
    # A fake coordinator can pass neither for a live one nor for one that finished the job.
    for phase in ("Running", "Succeeded"):
        fake = observe_coordinator([_pod("j-coordinator-0", "a", phase, owner="someone-else")],
                                   nodes, JOB_UID)
        assert not fake.alive and not fake.finished and fake.doomed == []
        assert fake.next_index == 1  # the real one gets a name of its own


def test_the_operators_own_annotation_does_not_change_a_pods_fingerprint():
    from lazarus_operator.observe import pod_fingerprint

    pod = _pod("j-worker-0", "a")
    before = pod_fingerprint(pod)
    pod["metadata"]["annotations"][builders.GENERATION_ANNOTATION] = "9"
    assert pod_fingerprint(pod) == before
    pod["status"]["phase"] = "Failed"
    assert pod_fingerprint(pod) != before


def test_a_pod_that_names_no_job_as_its_owner_asks_for_no_pass():
    """Rewriting a labelled pod of one's own over and over must not keep the operator busy."""
    from kubernetes import client
    from lazarus_core.cluster_contract import JOB_LABEL
    from lazarus_operator.reconciler import Reconciler

    reconciler = Reconciler(client.ApiClient())
    pod = _pod("j-worker-0", "a")
    pod["metadata"]["labels"][JOB_LABEL] = "j"
    assert reconciler.pod_changed(pod, deleted=False)
    forged = _pod("j-worker-1", "a", owner="whatever")
    forged["metadata"]["labels"][JOB_LABEL] = "j"
    forged["metadata"]["ownerReferences"] = []
    assert not reconciler.pod_changed(forged, deleted=False)
    assert not reconciler.pod_changed(forged, deleted=True)


def test_exit_reasons_read_back_whatever_the_last_words_say():
    for words in ("", "ValueError: x (its node agent in pod y says)", "a: b: c"):
        for uid in ("", "0d1e-77"):
            assert exit_of(exit_reason(-9, words, uid)) == ExitReport(
                uid, "exit status -9" + (f": {words}" if words else ""))
    assert exit_of("no heartbeat for 3.0 s") is None
