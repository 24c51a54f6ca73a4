"""What the cluster says about a job's workers, reduced to what the controller core reads.

Pure functions over pod and node manifests (dicts as the API returns them): which nodes
have a live worker, which are under a spot notice, which pods are still starting, which
must be cleaned up, and whether the job's coordinator lives. Unit-tested without a cluster.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lazarus_core.cluster_contract import exit_of
from lazarus_core.job_spec import JobSpec
from lazarus_core.plan import member_device, member_node
from lazarus_core.topology import NodeSpec

from .builders import INDEX_LABEL
from .capacity import is_spot

ZONE_LABEL = "topology.kubernetes.io/zone"


@dataclass(frozen=True)
class NodeInfo:
    """The parts of a Node the operator acts on."""
    name: str
    zone: str
    spot: bool
    ready: bool
    taints: frozenset[str]

    @classmethod
    def from_manifest(cls, node: Mapping) -> "NodeInfo":
        meta = node.get("metadata", {})
        labels = meta.get("labels") or {}
        conditions = (node.get("status") or {}).get("conditions") or []
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        taints = frozenset(t.get("key", "") for t in (node.get("spec") or {}).get("taints") or [])
        return cls(
            name=meta["name"],
            zone=labels.get(ZONE_LABEL, ""),
            spot=is_spot(labels),
            ready=ready and not meta.get("deletionTimestamp"),
            taints=taints,
        )

    def spec(self, job: JobSpec) -> NodeSpec:
        return NodeSpec(self.name, job.gpus_per_node, job.slots_per_gpu, self.zone,
                        "spot" if self.spot else "on-demand")


@dataclass
class Observation:
    live: list[NodeSpec] = field(default_factory=list)
    noticed: set[str] = field(default_factory=set)
    # Pods created but not running yet: workers on their way, not to be created twice.
    starting: list[str] = field(default_factory=list)
    # node name -> live worker pod name
    pod_on: dict[str, str] = field(default_factory=dict)
    # Every worker index in use by some pod (terminating ones too): names never collide.
    used_indices: set[int] = field(default_factory=set)
    # Pods to delete: finished or failed, or stranded on a node that is gone or NotReady.
    # (name, force): force for pods no kubelet will ever confirm deleting.
    doomed: list[tuple[str, bool]] = field(default_factory=list)
    # Pods whose worker exited with an error: (pod uid, node, what it said last). Also a
    # pod still running whose every rank its agent saw exit: the pod ends soon, and telling
    # now keeps a replacement from starting before the controller knows the worker failed.
    failed: list[tuple[str, str, str]] = field(default_factory=list)


def observe_workers(pods: Sequence[Mapping], nodes: Mapping[str, NodeInfo | None],
                    job: JobSpec, owner_uid: str,
                    suspects: Mapping[str, str] | None = None) -> Observation:
    """Classify the job's worker pods. ``nodes`` maps each pod's node to its info, or None
    when the node no longer exists. Only pods the job owns (``owner_uid``, by owner
    reference: labels can be copied by anyone who may create a pod) count as its workers;
    another pod's name is still never reused. ``suspects``: rank processes
    (``plan.member_name``) the coordinator found lost (exited, no heartbeat, a hung loop)
    while Kubernetes still shows their pod running, each with the reason. A node with every
    rank lost counts as lost, one with some as a node without those ranks' GPUs; their pods
    are kept, so that a rank that resumes can be taken back."""
    lost_gpus: dict[str, dict[int, str]] = {}
    for member, reason in (suspects or {}).items():
        try:
            lost_gpus.setdefault(member_node(member), {})[member_device(member)] = reason
        except ValueError:
            continue  # not a coordinator's finding: a malformed ConfigMap reads as absent
    notice_taints = set(job.spot_notice_taints)
    out = Observation()
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
        index = (meta.get("labels") or {}).get(INDEX_LABEL, "")
        if index.isdigit():
            out.used_indices.add(int(index))
        if meta.get("deletionTimestamp") or not _owned(meta, owner_uid):
            continue
        phase = status.get("phase", "Pending")
        node_name = spec.get("nodeName")
        if phase in ("Failed", "Succeeded"):  # evicted pods are Failed with reason Evicted
            out.doomed.append((meta["name"], False))
            if phase == "Failed" and status.get("reason") != "Evicted" \
                    and not _disruption_target(status):
                out.failed.append((meta.get("uid", meta["name"]), node_name or "",
                                   _failure_message(status)))
            continue
        if not node_name:
            out.starting.append(meta["name"])
            continue
        node = nodes.get(node_name)
        if node is None or not node.ready:
            out.doomed.append((meta["name"], True))
            continue
        if phase != "Running":
            out.starting.append(meta["name"])
            continue
        if node_name in out.pod_on:
            # Two workers on one node cannot happen through the anti-affinity; if it does,
            # keep the first so that a node is one failure domain.
            out.doomed.append((meta["name"], False))
            continue
        out.pod_on[node_name] = meta["name"]
        live = node.spec(job)
        # Lost ranks, each with its exit if its agent saw it; an exit the pod before this one
        # on the node reported says nothing of this pod's rank (it has not said hello yet).
        uid = meta.get("uid", meta["name"])
        lost = {d: how for d, reason in lost_gpus.get(node_name, {}).items()
                if (how := exit_of(reason)) is None or how.pod_uid == uid}
        if set(live.devices) <= lost.keys():
            exits = [lost[d] for d in live.devices]
            if all(exits):
                out.failed.append((uid, node_name, exits[0].message))
            continue
        out.live.append(live.without_gpus(set(lost)) if lost else live)
        if node.taints & notice_taints or _disruption_target(status):
            out.noticed.add(node_name)
    return out


@dataclass
class CoordinatorObservation:
    alive: bool = False
    # It exited 0: the job trained spec.steps steps (a coordinator stopped any other way
    # exits non-zero). Nothing to replace, and its pod stays, with its log.
    finished: bool = False
    # Its dead incarnations' pods, to clean up: (name, force) as for workers.
    doomed: list[tuple[str, bool]] = field(default_factory=list)
    next_index: int = 0


def observe_coordinator(pods: Sequence[Mapping], nodes: Mapping[str, NodeInfo | None],
                        owner_uid: str) -> CoordinatorObservation:
    """Whether some incarnation of the job's coordinator is alive (running, or on its way)
    or finished the job, and which dead ones to clean up: failed, or on a node that is gone
    or NotReady (whose kubelet will never report the process's fate). Only pods the job owns
    count (a pod that merely wears the labels cannot pass for a live or finished one); the
    next incarnation's name skips every labelled pod's."""
    out = CoordinatorObservation()
    for pod in pods:
        meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
        index = (meta.get("labels") or {}).get(INDEX_LABEL, "")
        if index.isdigit():
            out.next_index = max(out.next_index, int(index) + 1)
        if meta.get("deletionTimestamp") or not _owned(meta, owner_uid):
            continue
        node_name = spec.get("nodeName")
        node = nodes.get(node_name) if node_name else None
        if status.get("phase") == "Succeeded":
            out.finished = True
        elif status.get("phase") == "Failed":
            out.doomed.append((meta["name"], False))
        elif node_name and (node is None or not node.ready):
            out.doomed.append((meta["name"], True))
        else:
            out.alive = True
    return out


def _owned(meta: Mapping, owner_uid: str) -> bool:
    return any(r.get("uid") == owner_uid for r in meta.get("ownerReferences") or [])


def slim_pod(pod: Mapping) -> dict:
    """The parts of a pod that ``observe_workers``, ``observe_coordinator`` and
    ``pod_fingerprint`` read, and nothing else: a pod as the API server sends it is about
    40 KB of Python objects (managed fields, the whole spec), and the operator keeps every
    worker's, 40 MB at a thousand nodes (bench_operator_replan.py)."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    statuses = status.get("containerStatuses") or []
    terminated = ((statuses[0].get("state") or {}).get("terminated")
                  if statuses else None)
    return {
        "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "labels",
                                          "deletionTimestamp", "ownerReferences") if k in meta},
        "spec": {"nodeName": (pod.get("spec") or {}).get("nodeName")},
        "status": {
            **{k: status[k] for k in ("phase", "reason") if k in status},
            "conditions": [{"type": c.get("type"), "status": c.get("status")}
                           for c in status.get("conditions") or []
                           if c.get("type") == "DisruptionTarget"],
            "containerStatuses": ([{"state": {"terminated": {
                k: terminated.get(k) for k in ("message", "reason", "exitCode")
                if k in terminated}}}] if terminated else []),
        },
    }


def pod_fingerprint(pod: Mapping) -> tuple:
    """Everything ``observe_workers`` reads from a pod: if it is unchanged, so is the job."""
    meta, status = pod["metadata"], pod.get("status") or {}
    return (
        status.get("phase"),
        (pod.get("spec") or {}).get("nodeName"),
        bool(meta.get("deletionTimestamp")),
        _disruption_target(status),
        (meta.get("labels") or {}).get(INDEX_LABEL),
    )


def _failure_message(status: Mapping) -> str:
    """A failed worker's exit code and its last words (the termination message's last line:
    FallbackToLogsOnError puts its log's tail there)."""
    statuses = status.get("containerStatuses") or [{}]
    ended = (statuses[0].get("state") or {}).get("terminated") or {}
    lines = [line for line in (ended.get("message") or "").splitlines() if line.strip()]
    said = lines[-1].strip()[:500] if lines else ended.get("reason") or "no message"
    return f"exit code {ended.get('exitCode', '?')}: {said}"


def _disruption_target(status: Mapping) -> bool:
    """The pod condition Kubernetes sets before evicting or preempting a pod."""
    return any(c.get("type") == "DisruptionTarget" and c.get("status") == "True"
               for c in status.get("conditions") or [])

