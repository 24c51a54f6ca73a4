"""The operator's pure parts: the manifests it builds and how it reads pods and nodes."""
import json

import pytest

pytest.importorskip("kopf")  # the operator extra

from lazarus_core.job_spec import parse_spec  # noqa: E402
from lazarus_core.solver import plan_job  # noqa: E402
from lazarus_core.topology import NodeSpec  # noqa: E402
from lazarus_operator import builders  # noqa: E402
from lazarus_operator.observe import NodeInfo, observe_workers  # noqa: E402

SPEC = parse_spec({
    "runtime": {"model": "tiny", "experts": 4, "layers": 2},
    "minNodes": 2, "maxNodes": 4, "gpusPerNode": 2, "slotsPerGpu": 2,
    "checkpoint": {"path": "/ckpt", "everySteps": 10},
    "spotNoticeTaints": [{"key": "karpenter.sh/disrupted"}],
    "coordinator": {"nodeSelector": {"pool": "cpu"}},
    "template": {"image": "img:1", "nodeSelector": {"pool": "gpu"}, "serviceAccountName": "sa",
                 "labels": {"team": "moe", "lazarus.dev/role": "not-mine"},
                 "resources": {"limits": {"nvidia.com/gpu": 2}},
                 "tolerations": [{"key": "spot", "operator": "Exists"}],
                 "env": [{"name": "EXTRA", "value": "1"},
                         {"name": "LAZARUS_JOB", "value": "cannot override"}]},
})


def test_worker_pod_carries_the_plan_location_and_secure_defaults():
    pod = builders.build_worker_pod("j", "ns", SPEC, 3, generation=7)
    assert pod["metadata"]["name"] == "j-worker-3"
    assert pod["metadata"]["annotations"][builders.GENERATION_ANNOTATION] == "7"
    c = pod["spec"]["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert env["LAZARUS_PLAN_CONFIGMAP"]["value"] == "j-plan"
    assert env["LAZARUS_JOB"]["value"] == "j"  # the template cannot redirect a worker
    assert env["EXTRA"]["value"] == "1"
    assert json.loads(env["LAZARUS_RUNTIME"]["value"])["model"] == "tiny"
    assert env["LAZARUS_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["LAZARUS_COORDINATOR"]["value"] == "j-coordinator.ns.svc:29400"
    assert pod["metadata"]["labels"]["team"] == "moe"  # the template's labels ride along,
    assert pod["metadata"]["labels"]["lazarus.dev/role"] == "worker"  # never over ours
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"  # a Quantity string
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["nodeSelector"] == {"pool": "gpu"}
    anti = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"


def test_coordinator_pod_runs_on_regular_capacity_and_its_service_selects_only_it():
    pod = builders.build_coordinator_pod("j", "ns", SPEC, port=1234)
    svc = builders.build_coordinator_service("j", "ns", port=1234)
    c = pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert pod["metadata"]["name"] == svc["metadata"]["name"] == "j-coordinator"
    assert c["command"][-1] == "lazarus_runtime.cluster_coordinator"
    assert (env["LAZARUS_PLAN_CONFIGMAP"], env["LAZARUS_COORDINATOR_PORT"]) == ("j-plan", "1234")
    assert env["EXTRA"] == "1" and env["LAZARUS_JOB"] == "j"
    # spec.coordinator places it; none of the workers' GPU request, selector or tolerations.
    assert pod["spec"]["nodeSelector"] == {"pool": "cpu"} and pod["spec"]["tolerations"] == []
    assert "nvidia.com/gpu" not in json.dumps(c["resources"])
    assert pod["spec"]["serviceAccountName"] == "sa"
    assert pod["metadata"]["labels"]["team"] == "moe"
    selected = svc["spec"]["selector"]
    assert all(pod["metadata"]["labels"][k] == v for k, v in selected.items())
    worker = builders.build_worker_pod("j", "ns", SPEC, 0, generation=1)
    assert not all(worker["metadata"]["labels"].get(k) == v for k, v in selected.items())
    assert svc["spec"]["ports"][0]["port"] == 1234
    assert "LAZARUS_STEPS" not in env  # trains until deleted
    finite = builders.build_coordinator_pod("j", "ns", parse_spec(
        {"runtime": {"experts": 4, "layers": 2}, "minNodes": 2, "maxNodes": 4,
         "slotsPerGpu": 4, "steps": 300}))
    assert {e["name"]: e["value"] for e in finite["spec"]["containers"][0]["env"]}[
        "LAZARUS_STEPS"] == "300"


def test_plan_configmap_round_trips_the_plan_and_flags_a_restore():
    nodes = [NodeSpec(f"n{i}", 2, 2) for i in range(3)]
    plan = plan_job(nodes, 4, 2, 2)
    cm = builders.build_plan_configmap("j", "ns", plan, {"generation": 1, "step": 20})
    assert cm["metadata"]["annotations"][builders.GENERATION_ANNOTATION] == "1"
    assert type(plan).from_json(cm["data"][builders.PLAN_KEY]) == plan
    assert json.loads(cm["data"][builders.RESTORE_KEY])["step"] == 20
    assert builders.RESTORE_KEY not in builders.build_plan_configmap("j", "ns", plan)["data"]
    assert json.loads(cm["data"][builders.DRAINING_KEY]) == []
    drained = builders.build_plan_configmap("j", "ns", plan, draining=("n9", "n7"))
    assert json.loads(drained["data"][builders.DRAINING_KEY]) == ["n7", "n9"]


def _node(name, ready=True, taints=(), labels=None):
    return {"metadata": {"name": name, "labels": labels or {}},
            "spec": {"taints": [{"key": k, "effect": "NoSchedule"} for k in taints]},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def _pod(name, node=None, phase="Running", index=0, deleting=False, conditions=(), progress=None):
    meta = {"name": name, "labels": {builders.INDEX_LABEL: str(index)}, "annotations": {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    if progress:
        meta["annotations"][builders.PROGRESS_ANNOTATION] = json.dumps(progress)
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
        _pod("j-worker-0", "a", index=0, progress={"step": 7, "generation": 2, "checkpointStep": 5}),
        _pod("j-worker-1", "b", index=1),
        _pod("j-worker-2", "c", index=2),
        _pod("j-worker-3", None, phase="Pending", index=3),
        _pod("j-worker-4", "gone", index=4),
        _pod("j-worker-5", "d", phase="Failed", index=5),  # e.g. evicted
        _pod("j-worker-6", "d", index=6, deleting=True),
        _pod("j-worker-7", "d", index=7,
             conditions=[{"type": "DisruptionTarget", "status": "True"}]),
    ]
    obs = observe_workers(pods, nodes, SPEC)
    assert [n.name for n in obs.live] == ["a", "b", "d"]
    assert obs.live[0] == NodeSpec("a", 2, 2, "z1", "spot")
    assert obs.noticed == {"b", "d"}
    assert obs.starting == ["j-worker-3"]
    assert obs.doomed == [("j-worker-2", True), ("j-worker-4", True), ("j-worker-5", False)]
    assert obs.used_indices == set(range(8))
    assert (obs.progress.step, obs.progress.generation, obs.progress.checkpoint_step) == (7, 2, 5)


def test_a_garbled_progress_report_is_ignored():
    pods = [_pod("j-worker-0", "a", progress={"step": "x"})]
    obs = observe_workers(pods, {"a": NodeInfo.from_manifest(_node("a"))}, SPEC)
    assert obs.progress is None and len(obs.live) == 1


def test_the_operators_own_annotation_does_not_change_a_pods_fingerprint():
    from lazarus_operator.observe import pod_fingerprint

    pod = _pod("j-worker-0", "a")
    before = pod_fingerprint(pod)
    pod["metadata"]["annotations"][builders.GENERATION_ANNOTATION] = "9"
    assert pod_fingerprint(pod) == before
    pod["metadata"]["annotations"][builders.PROGRESS_ANNOTATION] = '{"step": 1, "generation": 1}'
    assert pod_fingerprint(pod) != before
