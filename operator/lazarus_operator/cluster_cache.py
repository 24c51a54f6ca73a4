"""What the watches told the operator about a job's pods, their nodes and the job's state.

A re-plan must not wait for a list of 500 pods or a lookup of each node, so passes read
pods, nodes and the state ConfigMap the coordinator writes from here, kept current by the
watch handlers. The cache can never drift far: ``resync`` lists the job's pods in full,
re-reads their nodes and the state, which catches anything a watch missed; a fresh job
state's pass calls it, and the heartbeat calls it between passes (``Reconciler._resync``).
What a watch delivers while a list is being read is newer than the list, and the list never
undoes it: every event is numbered, and a list keeps only what no event newer than its
start has touched.
"""
from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Iterable

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lazarus_core.cluster_contract import JOB_LABEL, ROLE_LABEL, state_configmap_name

from .kube_api import list_json_pages
from .observe import NodeInfo, pod_fingerprint, slim_pod

Key = tuple[str, str]  # (namespace, job name)
ROLES = ("worker", "coordinator")
# A deleted node is remembered as gone this long. By then no job's pod names it any more (a
# pass deletes the pods stranded on it), and a spot cluster that names every new node anew
# would otherwise grow the set with each node it ever lost. One that a pod still names after
# that is looked up once (``node_infos``), and found gone.
GONE_KEPT_S = 3600.0


class ClusterCache:
    def __init__(self, core: client.CoreV1Api, clock: Callable[[], float] = time.monotonic):
        self.core = core
        self.clock = clock
        self.nodes: dict[str, NodeInfo] = {}
        # Nodes seen deleted, and when, oldest first: known gone without asking the API
        # server (a spot reclaim deletes many at once, and each lookup would delay the
        # re-plan).
        self.gone: dict[str, float] = {}
        # A number for each event, and the latest of each node, pod and state ConfigMap: a
        # list that began before an object's latest event must not undo it (``resync``).
        self._events = itertools.count(1)
        self._event_of: dict[tuple[str, ...], int] = {}
        self._pods: dict[tuple[Key, str], dict[str, dict]] = {}  # (job, role) -> pods
        self._fingerprints: dict[tuple[str, str], tuple] = {}
        self._states: dict[Key, dict[str, str]] = {}
        self._guard = threading.Lock()

    # --- fed by the watches --------------------------------------------------------------

    def node_changed(self, node: dict | None, name: str) -> bool:
        """Record a node event; whether it changed anything a job reads (readiness, taints,
        existence)."""
        after = NodeInfo.from_manifest(node) if node is not None else None
        with self._guard:
            self._event_of[("node", name)] = next(self._events)
            before = self.nodes.get(name)
            if after is None:
                self.nodes.pop(name, None)
                self._went(name)
            else:
                self.nodes[name] = after
                self.gone.pop(name, None)
        return before is None or after is None or (before.ready, before.taints) != (
            after.ready, after.taints)

    def pod_changed(self, job: Key, role: str, pod: dict, deleted: bool) -> bool:
        """Record a pod event; whether it changed anything the controller reads (not, for
        example, the operator's own generation annotation: hundreds of those must not
        trigger re-plans)."""
        name = pod["metadata"]["name"]
        key = (job[0], name)
        with self._guard:
            self._event_of[("pod", *job, name)] = next(self._events)
            pods = self._pods.setdefault((job, role), {})
            if deleted:
                pods.pop(name, None)
                self._fingerprints.pop(key, None)
                return True
            pods[name] = pod = slim_pod(pod)
            fingerprint = pod_fingerprint(pod)
            if self._fingerprints.get(key) == fingerprint:
                return False
            self._fingerprints[key] = fingerprint
            return True

    def state_changed(self, job: Key, data: dict[str, str] | None) -> bool:
        """Record the job's state ConfigMap (None: deleted); whether it changed."""
        with self._guard:
            self._event_of[("state", *job)] = next(self._events)
            before = self._states.get(job)
            self._states[job] = dict(data or {})
            return before != self._states[job]

    def forget(self, job: Key) -> None:
        with self._guard:
            for role in ROLES:
                for name in self._pods.pop((job, role), {}):
                    self._fingerprints.pop((job[0], name), None)
            self._states.pop(job, None)
            for key in [k for k in self._event_of if k[:3] in (("pod", *job), ("state", *job))]:
                del self._event_of[key]

    # --- read by passes ------------------------------------------------------------------

    def pods(self, job: Key, role: str) -> list[dict]:
        """The job's pods of ``role`` as the watch and the latest ``resync`` left them. Pods
        this operator created moments ago may not be in the cache yet: creating them again
        meets "already exists", which is harmless."""
        with self._guard:
            return list(self._pods.get((job, role), {}).values())

    def state(self, job: Key, owner_uid: str) -> dict[str, str]:
        """The data of the job's state ConfigMap (read once if neither the watch nor a
        ``resync`` has brought it yet)."""
        with self._guard:
            known = job in self._states
        if not known:
            self._read_state(job, owner_uid)
        with self._guard:
            return dict(self._states.get(job, {}))

    def resync(self, job: Key, owner_uid: str) -> None:
        """List the job's pods of every role afresh, re-read the nodes they run on and the
        job's state: what a watch missed is caught here. On a loaded control plane at a
        thousand pods and a few thousand nodes this takes seconds (bench_operator_replan.py),
        so passes do not wait for it, except a fresh job state's."""
        pods = [pod for role in ROLES for pod in self._list_pods(job, role)]
        self._refresh_nodes(pods)
        self._read_state(job, owner_uid)

    def _list_pods(self, job: Key, role: str) -> list[dict]:
        """The job's pods of ``role`` listed afresh, into the cache: a pod whose watch event
        came after the list began stays as that event left it (deleted ones too)."""
        listing = self._event()
        listed = {p["metadata"]["name"]: slim_pod(p) for page in list_json_pages(
            self.core.list_namespaced_pod, job[0],
            label_selector=f"{JOB_LABEL}={job[1]},{ROLE_LABEL}={role}") for p in page}
        with self._guard:
            cached = self._pods.get((job, role), {})
            pods = {}
            for name in listed.keys() | cached.keys():
                newer = self._event_of.get(("pod", *job, name), 0) > listing
                pod = (cached if newer else listed).get(name)
                if pod is not None:
                    pods[name] = pod
                elif not newer:
                    self._event_of.pop(("pod", *job, name), None)  # gone for good
            self._pods[(job, role)] = pods
            return list(pods.values())

    def _read_state(self, job: Key, owner_uid: str) -> None:
        """Read the job's state ConfigMap into the cache, empty if the ConfigMap of that name
        is not the job's (``owner_uid``): a ConfigMap in the way is the job's NameConflict,
        never its state. An event the watch delivered meanwhile is newer and stays."""
        reading = self._event()
        try:
            cm = self.core.read_namespaced_config_map(state_configmap_name(job[1]), job[0])
            owners = cm.metadata.owner_references or []
            data = (cm.data or {}) if any(r.uid == owner_uid for r in owners) else {}
        except ApiException as e:
            if e.status != 404:
                raise
            data = {}
        with self._guard:
            if self._event_of.get(("state", *job), 0) < reading:
                self._states[job] = dict(data)

    def _event(self) -> int:
        with self._guard:
            return next(self._events)

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
                    with self._guard:
                        self._went(node)
            infos[node] = self.nodes.get(node)
        return infos

    def _refresh_nodes(self, pods: Iterable[dict]) -> None:
        """Re-read the nodes these pods run on: the node watch may have missed a deletion.
        It lists every node in the cluster, so it is called once for all the job's pods.
        What the watch delivered while the list was read is newer than the list, which can
        take seconds at a few thousand nodes: a reclaim's deletions that came meanwhile must
        not come back to life."""
        names = {(p.get("spec") or {}).get("nodeName") for p in pods} - {None}
        if not names:
            return
        listing = self._event()
        present: dict[str, NodeInfo] = {}
        for page in list_json_pages(self.core.list_node):
            present.update((n["metadata"]["name"], NodeInfo.from_manifest(n))
                           for n in page if n["metadata"]["name"] in names)
        with self._guard:
            for node in names:
                if self._event_of.get(("node", node), 0) > listing:
                    continue
                if node in present:
                    self.nodes[node] = present[node]
                    self.gone.pop(node, None)
                else:
                    self.nodes.pop(node, None)
                    self._went(node)

    def _went(self, node: str) -> None:
        """Remember ``node`` as gone, and forget those gone for longer than GONE_KEPT_S
        (with the guard held)."""
        now = self.clock()
        self.gone.pop(node, None)  # to the end: the dict stays in the order they went
        self.gone[node] = now
        while (oldest := next(iter(self.gone))) != node and (
                self.gone[oldest] < now - GONE_KEPT_S):
            del self.gone[oldest]
            self._event_of.pop(("node", oldest), None)
