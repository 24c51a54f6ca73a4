"""Pure builders for the objects a LazarusJob owns: worker pods, the plan ConfigMap, the
workers' headless Service. They take plain data and return manifests (dicts), so they are
unit-tested without a cluster; the handlers decide when to apply them.

The contract with the workers (runtime/): each pod gets
- LAZARUS_PLAN_CONFIGMAP: the ConfigMap holding ``plan.json`` (the latest generation) and,
  when the latest reconfiguration lost experts, ``restore.json``; workers watch it;
- LAZARUS_JOB, LAZARUS_NAMESPACE, LAZARUS_POD_NAME, LAZARUS_NODE_NAME (downward API);
- LAZARUS_RUNTIME: ``spec.runtime`` as JSON; LAZARUS_CHECKPOINT_PATH / _EVERY_STEPS;
- LAZARUS_WORKERS_SERVICE: the headless Service whose DNS names reach the other workers.
Rank 0 reports progress by writing PROGRESS_ANNOTATION (JSON: step, generation, loads,
checkpointStep) on its own pod; the operator reads it.
"""
from __future__ import annotations

import json
from collections.abc import Mapping

from lazarus_core.job_spec import JobSpec
from lazarus_core.plan import Plan

GROUP = "lazarus.dev"
VERSION = "v1alpha1"
PLURAL = "lazarusjobs"
JOB_LABEL = f"{GROUP}/job"
ROLE_LABEL = f"{GROUP}/role"
INDEX_LABEL = f"{GROUP}/worker-index"
GENERATION_ANNOTATION = f"{GROUP}/plan-generation"
PROGRESS_ANNOTATION = f"{GROUP}/progress"
PLAN_KEY = "plan.json"
RESTORE_KEY = "restore.json"
DEFAULT_IMAGE = "ghcr.io/lazarus-moe/runtime:0.1.0"
DEFAULT_COMMAND = ["python", "-m", "lazarus_runtime.worker"]
WORKER_PORT = 29500  # c10d rendezvous and gloo/NCCL bootstrap


def plan_configmap_name(job: str) -> str:
    return f"{job}-plan"


def service_name(job: str) -> str:
    return f"{job}-workers"


def worker_name(job: str, index: int) -> str:
    return f"{job}-worker-{index}"


def selector(job: str) -> str:
    """Label selector of the job's worker pods (also the scale subresource's selector)."""
    return f"{JOB_LABEL}={job},{ROLE_LABEL}=worker"


def _labels(job: str) -> dict[str, str]:
    return {JOB_LABEL: job, ROLE_LABEL: "worker", "app.kubernetes.io/managed-by": "lazarus-operator"}


def build_worker_pod(job: str, namespace: str, spec: JobSpec, index: int,
                     generation: int) -> dict:
    """Worker pod ``index`` of ``job``: one per node, carrying where to find the plan."""
    t: Mapping = spec.template
    name = worker_name(job, index)
    env = [
        {"name": "LAZARUS_JOB", "value": job},
        {"name": "LAZARUS_NAMESPACE", "value": namespace},
        {"name": "LAZARUS_PLAN_CONFIGMAP", "value": plan_configmap_name(job)},
        {"name": "LAZARUS_WORKERS_SERVICE", "value": service_name(job)},
        {"name": "LAZARUS_RUNTIME", "value": json.dumps(dict(spec.runtime), sort_keys=True)},
        {"name": "LAZARUS_GPUS_PER_NODE", "value": str(spec.gpus_per_node)},
        {"name": "LAZARUS_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "LAZARUS_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ]
    if spec.checkpoint is not None:
        env += [{"name": "LAZARUS_CHECKPOINT_PATH", "value": spec.checkpoint.path},
                {"name": "LAZARUS_CHECKPOINT_EVERY_STEPS", "value": str(spec.checkpoint.every_steps)}]
    ours = {e["name"] for e in env}
    env += [e for e in t.get("env", []) if e.get("name") not in ours]
    container = {
        "name": "worker",
        "image": t.get("image", DEFAULT_IMAGE),
        "command": list(t.get("command", DEFAULT_COMMAND)),
        "env": env,
        "ports": [{"name": "rendezvous", "containerPort": WORKER_PORT}],
        "resources": _quantities(t.get("resources", {})),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    for key in ("imagePullPolicy", "volumeMounts"):
        if key in t:
            container[key] = t[key]
    pod_spec = {
        "containers": [container],
        # The operator replaces a failed worker with a fresh pod; a restart in place would
        # come back into a plan that has already moved on without it.
        "restartPolicy": "Never",
        "hostname": name,
        "subdomain": service_name(job),
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        # One worker per node: a node is the failure domain the plan reasons about.
        "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchLabels": {JOB_LABEL: job, ROLE_LABEL: "worker"}},
            "topologyKey": "kubernetes.io/hostname",
        }]}},
        "nodeSelector": dict(t.get("nodeSelector", {})),
        "tolerations": list(t.get("tolerations", [])),
        "enableServiceLinks": False,
    }
    for key, field in (("serviceAccountName", "serviceAccountName"),
                       ("priorityClassName", "priorityClassName"), ("volumes", "volumes")):
        if key in t:
            pod_spec[field] = t[key]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": _labels(job) | {INDEX_LABEL: str(index)},
            "annotations": {GENERATION_ANNOTATION: str(generation)},
        },
        "spec": pod_spec,
    }


def _quantities(resources: Mapping) -> dict:
    """Resource quantities as strings, as the API's Quantity type wants (YAML gives ints)."""
    return {kind: {name: str(q) for name, q in (amounts or {}).items()}
            for kind, amounts in resources.items()}


def build_plan_configmap(job: str, namespace: str, plan: Plan,
                         restore: Mapping | None = None) -> dict:
    """The published plan. ``restore`` (generation, step, lost) is present only when the
    workers of this generation must reload a checkpoint."""
    data = {PLAN_KEY: plan.to_json()}
    if restore is not None:
        data[RESTORE_KEY] = json.dumps(dict(restore), sort_keys=True)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": plan_configmap_name(job),
            "namespace": namespace,
            "labels": {JOB_LABEL: job, ROLE_LABEL: "plan"},
            "annotations": {GENERATION_ANNOTATION: str(plan.generation),
                            f"{GROUP}/plan-reason": plan.reason},
        },
        "data": data,
    }


def build_workers_service(job: str, namespace: str) -> dict:
    """Headless Service: stable DNS names (<pod>.<job>-workers) for rendezvous."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": service_name(job), "namespace": namespace,
                     "labels": {JOB_LABEL: job}},
        "spec": {
            "clusterIP": "None",
            # Workers must find each other while they are still starting up.
            "publishNotReadyAddresses": True,
            "selector": {JOB_LABEL: job, ROLE_LABEL: "worker"},
            "ports": [{"name": "rendezvous", "port": WORKER_PORT, "targetPort": WORKER_PORT}],
        },
    }


def build_event(job_ref: Mapping, reason: str, message: str, kind: str, now_iso: str,
                name: str) -> dict:
    """A core/v1 Event on the job (``kubectl describe lazarusjob`` shows it)."""
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": job_ref["namespace"]},
        "involvedObject": {"apiVersion": f"{GROUP}/{VERSION}", "kind": "LazarusJob",
                           "name": job_ref["name"], "namespace": job_ref["namespace"],
                           "uid": job_ref["uid"]},
        "reason": reason,
        "message": message[:1024],
        "type": kind,
        "firstTimestamp": now_iso,
        "lastTimestamp": now_iso,
        "count": 1,
        "source": {"component": "lazarus-operator"},
        "reportingComponent": "lazarus.dev/operator",
        "reportingInstance": "lazarus-operator",
    }
