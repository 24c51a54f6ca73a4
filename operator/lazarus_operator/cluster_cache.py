"""What the watches told the operator about the job's pods and their nodes.

A re-plan must not wait for a list of 500 pods or a lookup of each node, so passes read
pods and nodes from here, kept current by the watch handlers. The cache can never drift
far: a fresh job state and the periodic heartbeat pass list the job's pods in full and
re-read their nodes, which catches a deletion a watch missed.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Iterable

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from .kube_api import list_json
from .observe import NodeInfo, pod_fingerprint

Key = tuple[str, str]  # (namespace, job name)


class ClusterCache:
    def __init__(self, core: client.CoreV1Api):
        self.core = core
        self.nodes: dict[str, NodeInfo] = {}
        # Nodes the watch saw deleted: known gone without asking the API server (a spot
        # reclaim deletes many at once, and each lookup would delay the re-plan).
        self.gone: set[str] = set()
        self._pods: dict[Key, dict[str, dict]] = {}
        self._fingerprints: dict[tuple[str, str], tuple] = {}
        self._guard = threading.Lock()

    # --- fed by the watches --------------------------------------------------------------

    def node_changed(self, node: dict | None, name: str) -> bool:
        """Record a node event; whether it changed anything a job reads (readiness, taints,
        existence)."""
        before = self.nodes.get(name)
        after = NodeInfo.from_manifest(node) if node is not None else None
        if after is None:
            self.nodes.pop(name, None)
            self.gone.add(name)
        else:
            self.nodes[name] = after
            self.gone.discard(name)
        return before is None or after is None or (before.ready, before.taints) != (
            after.ready, after.taints)

    def pod_changed(self, job: Key, pod: dict, deleted: bool) -> bool:
        """Record a worker pod event; whether it changed anything the controller reads (not,
        for example, the operator's own generation annotation: hundreds of those must not
        trigger re-plans)."""
        name = pod["metadata"]["name"]
        key = (job[0], name)
        with self._guard:
            pods = self._pods.setdefault(job, {})
            if deleted:
                pods.pop(name, None)
                self._fingerprints.pop(key, None)
                return True
            pods[name] = pod
            fingerprint = pod_fingerprint(pod)
            if self._fingerprints.get(key) == fingerprint:
                return False
            self._fingerprints[key] = fingerprint
            return True

    def forget(self, job: Key) -> None:
        with self._guard:
            for name in self._pods.pop(job, {}):
                self._fingerprints.pop((job[0], name), None)

    # --- read by passes ------------------------------------------------------------------

    def worker_pods(self, job: Key, selector: str, full: bool) -> list[dict]:
        """The job's pods: from the watch, or, with ``full``, listed afresh (and their nodes
        re-read). Pods this operator created moments ago may not be in the cache yet:
        creating them again meets "already exists", which is harmless."""
        if not full:
            with self._guard:
                return list(self._pods.get(job, {}).values())
        pods = list_json(self.core.list_namespaced_pod, job[0], label_selector=selector)
        with self._guard:
            self._pods[job] = {p["metadata"]["name"]: p for p in pods}
        self._refresh_nodes(pods)
        return pods

    def node_infos(self, pods: Iterable[dict]) -> dict[str, NodeInfo | None]:
        """Each pod's node, None when it no longer exists."""
        infos: dict[str, NodeInfo | None] = {}
        for pod in pods:
            node = (pod.get("spec") or {}).get("nodeName")
            if not node or node in infos:
                continue
            if node not in self.nodes and node not in self.gone:
                try:  # not seen by the node watch yet (operator just started)
                    self.nodes[node] = NodeInfo.from_manifest(
                        json.loads(self.core.read_node(node, _preload_content=False).data))
                except ApiException as e:
                    if e.status != 404:
                        raise
            infos[node] = self.nodes.get(node)
        return infos

    def _refresh_nodes(self, pods: Iterable[dict]) -> None:
        """Re-read the nodes these pods run on: the node watch may have missed a deletion."""
        names = {(p.get("spec") or {}).get("nodeName") for p in pods} - {None}
        if not names:
            return
        present = {n["metadata"]["name"]: n
                   for n in list_json(self.core.list_node, resource_version="0")}
        for node in names:
            if node in present:
                self.nodes[node] = NodeInfo.from_manifest(present[node])
                self.gone.discard(node)
            else:
                self.nodes.pop(node, None)
                self.gone.add(node)
