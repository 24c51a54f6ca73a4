"""Pure builders for the objects a LazarusJob owns: worker pods, the coordinator pod and its
Service, the plan ConfigMap, the workers' headless Service, and what keeps the job to
itself: the key Secret, the coordinator's ServiceAccount and Role, and the NetworkPolicy.
They take plain data and return manifests (dicts), so they are unit-tested without a
cluster; the handlers decide when to apply them.

Least privilege, pod by pod: containers run as non-root with no capabilities, no privilege
escalation and a read-only root filesystem (scratch space is an emptyDir at /tmp); workers
mount no ServiceAccount token (they never call the API server) unless the job names a
ServiceAccount for them; the coordinator runs as its job's own ServiceAccount, whose Role
reaches only that job's objects; the job's key, which signs every message between them
(lazarus_runtime.job_channel), is in a Secret that only the job's pods reference.

The contracts with the runtime are defined once in the core: the names of the objects the
coordinator shares with the operator in ``lazarus_core.cluster_contract`` (the plan
ConfigMap's keys, the state ConfigMap's, the labels), and the processes' environment in
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
# The entry of the job's key Secret that holds the key.
KEY_SECRET_ENTRY = "key"
# Writable scratch space under a read-only root filesystem.
SCRATCH_VOLUME = "lazarus-scratch"
SCRATCH_PATH = "/tmp"
# The coordinator's resources unless spec.coordinator sets its own. Its process holds about
# 580 MiB from its start (torch, the Kubernetes client, the store), and stays flat over a
# long run: keys and records are pruned behind it (benchmarks/bench_coordinator_memory.py).
# The limit leaves room for that and bounds anything that would grow anyway.
COORDINATOR_RESOURCES = {"requests": {"cpu": "500m", "memory": "768Mi"},
                         "limits": {"memory": "2Gi"}}
_CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                       "readOnlyRootFilesystem": True}
_POD_SECURITY = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}


def service_name(job: str) -> str:
    return f"{job}-workers"


def coordinator_name(job: str) -> str:
    """The coordinator's Service, ServiceAccount, Role, RoleBinding and disruption budget
    (and the stem of its pods' names)."""
    return f"{job}-coordinator"


def coordinator_pod_name(job: str, index: int) -> str:
    """The coordinator's pod of incarnation ``index``: a replacement gets the next one, so
    it never waits for its predecessor's name to be freed."""
    return f"{coordinator_name(job)}-{index}"


def key_secret_prefix(job: str) -> str:
    """The key Secret's generateName: the API server adds a random suffix, so no object made
    before the job can be taken for it (the name is kept in the job's status.keySecret)."""
    return f"{job}-key-"


def network_policy_name(job: str) -> str:
    return f"{job}-network"


def worker_name(job: str, index: int) -> str:
    return f"{job}-worker-{index}"


def selector(job: str) -> str:
    """Label selector of the job's worker pods (also the scale subresource's selector)."""
    return f"{JOB_LABEL}={job},{ROLE_LABEL}=worker"


def _labels(job: str, role: str, template: Mapping) -> dict[str, str]:
    """The template's extra labels, then ours (which it cannot override)."""
    return dict(template.get("labels") or {}) | {
        JOB_LABEL: job, ROLE_LABEL: role, "app.kubernetes.io/managed-by": "lazarus-operator"}


def build_worker_pod(job: str, namespace: str, spec: JobSpec, index: int, generation: int,
                     key_secret: str, coordinator_port: int = COORDINATOR_PORT, *,
                     job_uid: str) -> dict:
    """Worker pod ``index`` of ``job``: one per node, carrying where to find the coordinator
    and, from the Secret ``key_secret``, the job's key."""
    t: Mapping = spec.template
    name = worker_name(job, index)
    coordinator = f"{coordinator_name(job)}.{namespace}.svc:{coordinator_port}"
    env = [{"name": k, "value": v} for k, v in (penv.worker_env(
        spec, job, coordinator, job_uid=job_uid) | {
        penv.NAMESPACE: namespace, penv.PLAN_CONFIGMAP: plan_configmap_name(job),
        penv.WORKERS_SERVICE: service_name(job),
    }).items()]
    env += [{"name": penv.POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": penv.POD_UID, "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
            {"name": penv.NODE_NAME, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            _key_env(key_secret)]
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
        "securityContext": dict(_CONTAINER_SECURITY),
        "volumeMounts": list(t.get("volumeMounts", [])),
    }
    if "imagePullPolicy" in t:
        container["imagePullPolicy"] = t["imagePullPolicy"]
    pod_spec = {
        "containers": [container],
        # The operator replaces a failed worker with a fresh pod; a restart in place would
        # come back into a plan that has already moved on without it.
        "restartPolicy": "Never",
        "hostname": name,
        "subdomain": service_name(job),
        "securityContext": dict(_POD_SECURITY),
        # Workers never call the API server: no token, unless the job gives them an account
        # of their own (e.g. for checkpoint storage credentials).
        "automountServiceAccountToken": "serviceAccountName" in t,
        # One worker per node: a node is the failure domain the plan reasons about.
        "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchLabels": {JOB_LABEL: job, ROLE_LABEL: "worker"}},
            "topologyKey": "kubernetes.io/hostname",
        }]}},
        "nodeSelector": dict(t.get("nodeSelector", {})),
        "tolerations": list(t.get("tolerations", [])),
        "enableServiceLinks": False,
        "volumes": list(t.get("volumes", [])),
    }
    for key in ("serviceAccountName", "priorityClassName"):
        if key in t:
            pod_spec[key] = t[key]
    _add_scratch(pod_spec, container)
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


def _key_env(key_secret: str) -> dict:
    return {"name": penv.JOB_KEY,
            "valueFrom": {"secretKeyRef": {"name": key_secret, "key": KEY_SECRET_ENTRY}}}


def _add_scratch(pod_spec: dict, container: dict) -> None:
    """An emptyDir at /tmp, unless the job mounts something of its own there."""
    if any(m.get("mountPath") == SCRATCH_PATH for m in container["volumeMounts"]):
        return
    pod_spec["volumes"].append({"name": SCRATCH_VOLUME, "emptyDir": {}})
    container["volumeMounts"].append({"name": SCRATCH_VOLUME, "mountPath": SCRATCH_PATH})


def _quantities(resources: Mapping) -> dict:
    """Resource quantities as strings, as the API's Quantity type wants (YAML gives ints)."""
    return {kind: {name: str(q) for name, q in (amounts or {}).items()}
            for kind, amounts in resources.items()}


def _credentials(spec: JobSpec) -> dict:
    """The checkpoint storage's credentials: every key of the Secret the spec names becomes
    an environment variable (AWS_ACCESS_KEY_ID, ...), so none is ever in the manifest. (The
    job's key is set by name, which takes precedence over anything from envFrom.)"""
    secret = spec.checkpoint.secret_name if spec.checkpoint else None
    return {"envFrom": [{"secretRef": {"name": secret}}]} if secret else {}


def build_coordinator_pod(job: str, namespace: str, spec: JobSpec, key_secret: str,
                          index: int = 0, port: int = COORDINATOR_PORT, *,
                          job_uid: str) -> dict:
    """The job's coordinator: one small CPU pod that outlives worker losses. It asks for no
    GPU, tolerates none of the GPU or spot taints the workers tolerate, and requires a node
    that no cloud labels as spot, so it lands on the cluster's regular (on-demand) capacity;
    ``spec.coordinator`` can pin it further. If it dies anyway, the operator starts the next
    incarnation, which carries on from the job's state ConfigMap and the workers. It runs as
    the job's own ServiceAccount (``build_coordinator_access``) and reads the job's key from
    the Secret ``key_secret``."""
    t: Mapping = spec.template
    placement: Mapping = spec.coordinator
    name = coordinator_pod_name(job, index)
    env = [{"name": k, "value": v} for k, v in penv.coordinator_env(
        job, namespace, plan_configmap_name(job), state_configmap_name(job), port, spec,
        job_uid).items()]
    env.append(_key_env(key_secret))
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
        "resources": _quantities(placement.get("resources") or COORDINATOR_RESOURCES),
        "securityContext": dict(_CONTAINER_SECURITY),
        "volumeMounts": [],
    }
    if "imagePullPolicy" in t:
        container["imagePullPolicy"] = t["imagePullPolicy"]
    pod_spec = {
        "containers": [container],
        # A dead coordinator is replaced by a new pod (the operator's choice of node and
        # name), not restarted in place: its node may be the thing that died.
        "restartPolicy": "Never",
        "securityContext": dict(_POD_SECURITY),
        "serviceAccountName": coordinator_name(job),
        # It follows the plan and writes the job's state through the API server.
        "automountServiceAccountToken": True,
        "nodeSelector": dict(placement.get("nodeSelector", {})),
        "affinity": not_spot_affinity(),
        "tolerations": list(placement.get("tolerations", [])),
        "enableServiceLinks": False,
        "volumes": [],
    }
    _add_scratch(pod_spec, container)
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


def build_key_secret(job: str, namespace: str, key: str) -> dict:
    """The job's key (``process_env.new_job_key``), which only the job's pods reference."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"generateName": key_secret_prefix(job), "namespace": namespace,
                     "labels": {JOB_LABEL: job}},
        "type": "Opaque",
        "stringData": {KEY_SECRET_ENTRY: key},
    }


def build_coordinator_access(job: str, namespace: str) -> list[dict]:
    """The coordinator's ServiceAccount, and a Role bound to it that reaches only what the
    coordinator of this job uses."""
    name = coordinator_name(job)
    meta = {"name": name, "namespace": namespace, "labels": {JOB_LABEL: job}}
    rules = [
        # Follow the job's plan: its one ConfigMap, by name (a watch with a metadata.name
        # field selector is allowed by resourceNames).
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"],
         "resourceNames": [plan_configmap_name(job)]},
        # Write the job's state (progress, lost workers), the durable record its next
        # incarnation starts from: its one ConfigMap, by name. No pod rights at all.
        {"apiGroups": [""], "resources": ["configmaps"],
         "verbs": ["get", "patch"], "resourceNames": [state_configmap_name(job)]},
    ]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": dict(meta),
         "automountServiceAccountToken": False},  # only the coordinator pod mounts it
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": dict(meta),
         "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": dict(meta),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]},
    ]


def build_network_policy(job: str, namespace: str) -> dict:
    """Only the job's own pods may connect to its pods: the coordinator's store and the
    workers' collectives (gloo picks its ports at run time, so every port is covered).
    Nothing else needs to: the operator talks to the API server, never to the pods.

    A NetworkPolicy selects by labels, which whoever may create pods in the namespace can
    copy; the job's key (every message is signed) is what holds against such a pod. The
    policy takes effect only on a cluster whose network plugin enforces NetworkPolicy."""
    job_pods = {"matchLabels": {JOB_LABEL: job}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": network_policy_name(job), "namespace": namespace,
                     "labels": {JOB_LABEL: job}},
        "spec": {"podSelector": job_pods, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"podSelector": job_pods}]}]},
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
