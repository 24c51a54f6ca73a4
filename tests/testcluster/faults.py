"""Fault injectors: what a spot reclaim, a dead kubelet or a zone outage looks like through
the Kubernetes API. Each works on kwok's simulated nodes and on kind's real ones.

Shell: ``hack/fault.sh --help``. Tests: call the functions with a ``CoreV1Api``.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import uuid
from dataclasses import dataclass

from kubernetes import client

from testcluster.nodepools import KWOK_NODE_ANNOTATION, ZONE_LABEL

# kwok's node-not-ready chaos stage (hack/kwok-stages.yaml) turns a node with this label
# NotReady, as its kubelet would report it.
KWOK_NOT_READY_LABEL = "node-not-ready.stage.kwok.x-k8s.io"
KWOK_NOT_READY_ANNOTATIONS = {
    "node-not-ready.stage.kwok.x-k8s.io/reason": "KubeletNotReady",
    "node-not-ready.stage.kwok.x-k8s.io/message": "injected by testcluster.faults",
}


@dataclass(frozen=True)
class SpotNotice:
    """How one cloud tool announces that a spot node is about to be reclaimed."""

    taint_key: str
    effect: str = "NoSchedule"
    cordons: bool = False  # whether the tool also cordons the node right away


SPOT_NOTICES = {
    # aws-node-termination-handler: taints (value: the interruption event id) and cordons
    # before it drains.
    "aws": SpotNotice("aws-node-termination-handler/spot-itn", cordons=True),
    # Karpenter taints a node it is about to disrupt, then deletes its NodeClaim.
    "karpenter": SpotNotice("karpenter.sh/disrupted"),
    # GKE taints a Spot VM's node when the preemption notice arrives (30 s before shutdown).
    "gke": SpotNotice("cloud.google.com/impending-node-termination"),
}


def _kind_container(node: client.V1Node) -> str | None:
    """The docker container behind a kind node, or None for any other node."""
    provider_id = node.spec.provider_id or ""
    if provider_id.startswith("kind://"):
        return provider_id.rsplit("/", 1)[-1]
    return None


def _is_kwok(node: client.V1Node) -> bool:
    return (node.metadata.annotations or {}).get(KWOK_NODE_ANNOTATION) == "fake"


def _unsupported(node: client.V1Node, fault: str) -> ValueError:
    return ValueError(
        f"cannot {fault} node {node.metadata.name}: it is neither a kwok node (annotation "
        f"{KWOK_NODE_ANNOTATION}=fake) nor a kind node (providerID kind://...)"
    )


def delete_node(core: client.CoreV1Api, name: str) -> None:
    """The machine is gone, as after a spot reclaim: its Node object is deleted. On kind, its
    container is removed first, so the kubelet cannot register the node again."""
    node = core.read_node(name)
    container = _kind_container(node)
    if container:
        subprocess.run(["docker", "rm", "--force", container], check=True, capture_output=True)
    elif not _is_kwok(node):
        raise _unsupported(node, "delete")
    core.delete_node(name)


def spot_notice(core: client.CoreV1Api, name: str, style: str) -> client.V1Taint:
    """Taint the node the way ``style`` (aws, karpenter, gke) announces a spot reclaim, and
    return the taint. The node keeps running, as it does until the notice period ends."""
    try:
        notice = SPOT_NOTICES[style]
    except KeyError:
        raise ValueError(f"unknown spot notice style {style!r}; choose from {sorted(SPOT_NOTICES)}") from None
    value = f"spot-itn-{uuid.uuid4().hex[:12]}" if style == "aws" else None
    taint = client.V1Taint(key=notice.taint_key, value=value, effect=notice.effect)
    _update_taints(
        core, name, lambda taints: [t for t in taints if t.key != taint.key] + [taint],
        unschedulable=True if notice.cordons else None,
    )
    return taint


def _update_taints(core: client.CoreV1Api, name: str, edit, *, unschedulable: bool | None = None) -> None:
    """Replace the node's taints with ``edit(taints)``, and set ``unschedulable`` if given."""
    # Taints are one atomic list: write it back with the resourceVersion we read, so a
    # concurrent change (the node lifecycle controller adds and removes taints too) makes us
    # retry rather than being overwritten.
    for _ in range(5):
        node = core.read_node(name)
        taints = edit(list(node.spec.taints or []))
        body = {
            "metadata": {"resourceVersion": node.metadata.resource_version},
            "spec": {"taints": [core.api_client.sanitize_for_serialization(t) for t in taints]},
        }
        if unschedulable is not None:
            body["spec"]["unschedulable"] = unschedulable
        try:
            core.patch_node(name, body)
            return
        except client.ApiException as e:
            if e.status != 409:
                raise
    raise RuntimeError(f"node {name} kept changing; could not update its taints")


def make_not_ready(core: client.CoreV1Api, name: str) -> None:
    """The node's kubelet reports NotReady (kwok), or stops (kind: the node controller marks it
    NotReady or Unknown after its grace period). The node lifecycle controller then taints it
    node.kubernetes.io/not-ready or unreachable, as on a real cluster."""
    _set_kubelet(core, name, ready=False)


def _set_kubelet(core: client.CoreV1Api, name: str, ready: bool) -> None:
    """Stop or start the node's kubelet: systemd in a kind node, kwok's NotReady stage
    otherwise (a JSON merge patch removes a key given as None)."""
    node = core.read_node(name)
    container = _kind_container(node)
    if container:
        subprocess.run(["docker", "exec", container, "systemctl",
                        "start" if ready else "stop", "kubelet"],
                       check=True, capture_output=True)
    elif _is_kwok(node):
        core.patch_node(name, {"metadata": {
            "labels": {KWOK_NOT_READY_LABEL: None if ready else "true"},
            "annotations": (dict.fromkeys(KWOK_NOT_READY_ANNOTATIONS) if ready
                            else KWOK_NOT_READY_ANNOTATIONS),
        }})
    else:
        raise _unsupported(node, "heal" if ready else "make NotReady")


def evict_pod(core: client.CoreV1Api, namespace: str, name: str) -> None:
    """Evict a pod through the Eviction API, as a drain does: PodDisruptionBudgets apply, and
    a refused eviction raises ApiException with status 429."""
    eviction = client.V1Eviction(metadata=client.V1ObjectMeta(name=name, namespace=namespace))
    core.create_namespaced_pod_eviction(name, namespace, eviction)


def zone_down(core: client.CoreV1Api, zone: str, *, delete: bool = False) -> list[str]:
    """Every node in ``zone`` goes NotReady (an outage) or, with ``delete``, disappears (the
    zone's spot capacity is reclaimed). Returns the affected node names."""
    names = [n.metadata.name for n in core.list_node(label_selector=f"{ZONE_LABEL}={zone}").items]
    if not names:
        raise ValueError(f"no node has {ZONE_LABEL}={zone}")
    for name in names:
        (delete_node if delete else make_not_ready)(core, name)
    return names


def heal_node(core: client.CoreV1Api, name: str) -> None:
    """Undo ``make_not_ready`` and ``spot_notice``: the kubelet reports Ready again, the notice
    taints go and the node is uncordoned. (Deleted nodes come back with hack/cluster.sh up.)"""
    _set_kubelet(core, name, ready=True)
    notice_keys = {notice.taint_key for notice in SPOT_NOTICES.values()}
    _update_taints(core, name, lambda taints: [t for t in taints if t.key not in notice_keys], unschedulable=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hack/fault.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubeconfig", required=True)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("delete-node", help="delete a node (spot reclaim)").add_argument("node")
    notice = commands.add_parser("spot-notice", help="taint a node with a spot termination notice")
    notice.add_argument("node")
    notice.add_argument("--style", choices=sorted(SPOT_NOTICES), required=True)
    commands.add_parser("not-ready", help="make a node NotReady").add_argument("node")
    evict = commands.add_parser("evict", help="evict a pod through the Eviction API")
    evict.add_argument("pod", metavar="NAMESPACE/POD")
    zone = commands.add_parser("zone-down", help="take every node of a zone down")
    zone.add_argument("zone")
    zone.add_argument("--delete", action="store_true", help="delete the nodes instead of NotReady")
    commands.add_parser("heal", help="undo not-ready and spot-notice on a node").add_argument("node")
    args = parser.parse_args(argv)
    try:
        _run(args)
    except (ValueError, client.ApiException) as e:
        reason = f"{e.status} {e.reason}" if isinstance(e, client.ApiException) else str(e)
        print(f"{parser.prog} {args.command}: {reason}", file=sys.stderr)
        return 1
    return 0


def _run(args) -> None:
    from testcluster.kube import core_v1

    core = core_v1(args.kubeconfig)
    if args.command == "delete-node":
        delete_node(core, args.node)
    elif args.command == "spot-notice":
        taint = spot_notice(core, args.node, args.style)
        print(f"tainted {args.node}: {taint.key}={taint.value or ''}:{taint.effect}")
    elif args.command == "not-ready":
        make_not_ready(core, args.node)
    elif args.command == "evict":
        namespace, _, pod = args.pod.partition("/")
        if not pod:
            raise ValueError(f"evict takes NAMESPACE/POD, got {args.pod!r}")
        evict_pod(core, namespace, pod)
    elif args.command == "heal":
        heal_node(core, args.node)
    else:
        print("\n".join(zone_down(core, args.zone, delete=args.delete)))


if __name__ == "__main__":
    sys.exit(main())
