"""Pure builders for the objects a LazarusJob owns: worker pods, the coordinator pod and its
Service, the plan ConfigMap, the workers' headless Service. They take plain data and return
manifests (dicts), so they are unit-tested without a cluster; the handlers decide when to
apply them.

The contracts with the runtime are defined once in the core: the names of the objects the
coordinator shares with the operator in ``lazarus_core.cluster_contract`` (the plan
ConfigMap's keys, the progress annotation, the labels), and the processes' environment in
``lazarus_core.process_env``.
"""
from __future__ import annotations

from collections.abc import Mapping

from lazarus_core import process_env as penv
from lazarus_core.cluster_contract import (API_VERSION, GROUP, JOB_LABEL, KIND, ROLE_LABEL,
                                           plan_configmap_data, plan_configmap_name,
                                           state_configmap_name)
from lazarus_core.job_spec import JobSpec
from lazarus_core.plan import Plan

from .capacity import not_spot_affinity

# The index in the name of a worker pod, or of a coordinator pod's incarnation.
INDEX_LABEL = f"{GROUP}/index"
GENERATION_ANNOTATION = f"{GROUP}/plan-generation"
DEFAULT_IMAGE = "ghcr.io/lazarus-moe/runtime:0.1.0"
# A worker pod is a node: its agent runs a rank process per GPU (gpusPerNode of them).
DEFAULT_COMMAND = ["python", "-m", "lazarus_runtime.node_agent"]
COORDINATOR_COMMAND = ["python", "-m", "lazarus_runtime.cluster_coordinator"]
WORKER_PORT = 29500  # gloo/NCCL bootstrap
COORDINATOR_PORT = 29400  # the coordinator's rendezvous store (c10d TCPStore)


def service_name(job: str) -> str:
    return f"{job}-workers"


def coordinator_name(job: str) -> str:
    """The coordinator's Service (and the stem of its pods' names)."""
    return f"{job}-coordinator"


def coordinator_pod_name(job: str, index: int) -> str:
    """The coordinator's pod of incarnation ``index``: a replacement gets the next one, so
    it never waits for its predecessor's name to be freed."""
    return f"{coordinator_name(job)}-{index}"


def worker_name(job: str, index: int) -> str:
    return f"{job}-worker-{index}"


def selector(job: str) -> str:
    """Label selector of the job's worker pods (also the scale subresource's selector)."""
    return f"{JOB_LABEL}={job},{ROLE_LABEL}=worker"


def _labels(job: str, role: str, template: Mapping) -> dict[str, str]:
    """The template's extra labels, then ours (which it cannot override)."""
    return dict(template.get("labels") or {}) | {
        JOB_LABEL: job, ROLE_LABEL: role, "app.kubernetes.io/managed-by": "lazarus-operator"}


def build_worker_pod(job: str, namespace: str, spec: JobSpec, index: int,
                     generation: int, coordinator_port: int = COORDINATOR_PORT, *,
                     job_uid: str) -> dict:
    """Worker pod ``index`` of ``job``: one per node, carrying where to find the coordinator."""
    t: Mapping = spec.template
    name = worker_name(job, index)
    coordinator = f"{coordinator_name(job)}.{namespace}.svc:{coordinator_port}"
    env = [{"name": k, "value": v} for k, v in (penv.worker_env(
        spec, coordinator, job_uid=job_uid) | {
        penv.JOB: job, penv.NAMESPACE: namespace, penv.PLAN_CONFIGMAP: plan_configmap_name(job),
        penv.WORKERS_SERVICE: service_name(job),
    }).items()]
    env += [{"name": penv.POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": penv.NODE_NAME, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    ours = {e["name"] for e in env}
    env += [e for e in t.get("env", []) if e.get("name") not in ours]
    container = {
        "name": "worker",
        "image": t.get("image", DEFAULT_IMAGE),
        "command": list(t.get("command", DEFAULT_COMMAND)),
        "env": env,
        **_credentials(spec),
        # A worker that fails says why in its last lines; the operator reports them.
        "terminationMessagePolicy": "FallbackToLogsOnError",
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
            "labels": _labels(job, "worker", t) | {INDEX_LABEL: str(index)},
            "annotations": {GENERATION_ANNOTATION: str(generation)},
        },
        "spec": pod_spec,
    }


def _quantities(resources: Mapping) -> dict:
    """Resource quantities as strings, as the API's Quantity type wants (YAML gives ints)."""
    return {kind: {name: str(q) for name, q in (amounts or {}).items()}
            for kind, amounts in resources.items()}


def _credentials(spec: JobSpec) -> dict:
    """The checkpoint storage's credentials: every key of the Secret the spec names becomes
    an environment variable (AWS_ACCESS_KEY_ID, ...), so none is ever in the manifest."""
    secret = spec.checkpoint.secret_name if spec.checkpoint else None
    return {"envFrom": [{"secretRef": {"name": secret}}]} if secret else {}


def build_coordinator_pod(job: str, namespace: str, spec: JobSpec, index: int = 0,
                          port: int = COORDINATOR_PORT, *, job_uid: str) -> dict:
    """The job's coordinator: one small CPU pod that outlives worker losses. It asks for no
    GPU, tolerates none of the GPU or spot taints the workers tolerate, and requires a node
    that no cloud labels as spot, so it lands on the cluster's regular (on-demand) capacity;
    ``spec.coordinator`` can pin it further. If it dies anyway, the operator starts the next
    incarnation, which carries on from the job's state ConfigMap and the workers."""
    t: Mapping = spec.template
    placement: Mapping = spec.coordinator
    name = coordinator_pod_name(job, index)
    env = [{"name": k, "value": v} for k, v in penv.coordinator_env(
        job, namespace, plan_configmap_name(job), state_configmap_name(job), port, spec,
        job_uid).items()]
    ours = {e["name"] for e in env}
    env += [e for e in t.get("env", []) if e.get("name") not in ours]
    container = {
        "name": "coordinator",
        "image": t.get("image", DEFAULT_IMAGE),
        "command": list(COORDINATOR_COMMAND),
        "env": env,
        **_credentials(spec),  # it reads the checkpoints to choose the one to restore
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "ports": [{"name": "rendezvous", "containerPort": port}],
        "resources": _quantities(placement.get("resources")
                                 or {"requests": {"cpu": "500m", "memory": "512Mi"}}),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if "imagePullPolicy" in t:
        container["imagePullPolicy"] = t["imagePullPolicy"]
    pod_spec = {
        "containers": [container],
        # A dead coordinator is replaced by a new pod (the operator's choice of node and
        # name), not restarted in place: its node may be the thing that died.
        "restartPolicy": "Never",
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "nodeSelector": dict(placement.get("nodeSelector", {})),
        "affinity": not_spot_affinity(),
        "tolerations": list(placement.get("tolerations", [])),
        "enableServiceLinks": False,
    }
    if "serviceAccountName" in t:
        pod_spec["serviceAccountName"] = t["serviceAccountName"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": _labels(job, "coordinator", t) | {INDEX_LABEL: str(index)}},
        "spec": pod_spec,
    }


def build_coordinator_pdb(job: str, namespace: str) -> dict:
    """Keeps voluntary disruptions (a drain, an autoscaler's consolidation) from taking the
    coordinator casually; to move it on purpose, delete its pod: a new one starts at once."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": coordinator_name(job), "namespace": namespace,
                     "labels": {JOB_LABEL: job}},
        "spec": {"minAvailable": 1,
                 "selector": {"matchLabels": {JOB_LABEL: job, ROLE_LABEL: "coordinator"}}},
    }


def build_state_configmap(job: str, namespace: str) -> dict:
    """The job's state, written by its coordinator (cluster_contract: progress and lost
    workers); the operator creates it empty, so that the job owns it."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": state_configmap_name(job), "namespace": namespace,
                     "labels": {JOB_LABEL: job, ROLE_LABEL: "state"}},
        "data": {},
    }


def build_coordinator_service(job: str, namespace: str, port: int = COORDINATOR_PORT) -> dict:
    """The stable name the workers reach the coordinator's store by."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": coordinator_name(job), "namespace": namespace,
                     "labels": {JOB_LABEL: job}},
        "spec": {
            "selector": {JOB_LABEL: job, ROLE_LABEL: "coordinator"},
            "ports": [{"name": "rendezvous", "port": port, "targetPort": port}],
        },
    }


def build_plan_configmap(job: str, namespace: str, plan: Plan,
                         draining: tuple[str, ...] = ()) -> dict:
    """The published plan; ``draining``: the nodes out of the plan whose workers still hold
    experts to send (spot notice)."""
    data = plan_configmap_data(plan, draining)
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
        "involvedObject": {"apiVersion": API_VERSION, "kind": KIND,
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
