"""Reconciling a LazarusJob: observe the cluster, run the controller core, apply its decisions.

Level-triggered: every pass reads the job, its pods and their nodes, turns the difference
from the controller state into events, and applies what the core decides. The state lives
in the API server (the plan ConfigMap and the job's status); the in-memory copy is only a
cache, rebuilt from them after a restart or whenever applying a decision fails
(``rebuild``). So killing the operator at any point loses nothing: the next pass re-derives
what is missing, pods have deterministic names, and "already exists" is a normal outcome.

The rooms: ``job_queue`` (passes never overlap; timers), ``cluster_cache`` (pods and nodes
from the watches), ``rebuild`` (state from the API server), ``apply`` (decisions and status)
and ``kube_api`` (the calls themselves).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lazarus_core import controller as core
from lazarus_core.cluster_contract import (GROUP, JOB_LABEL, KIND, PLURAL, ROLE_LABEL, VERSION,
                                           read_state_configmap, state_configmap_name)
from lazarus_core.job_spec import JobSpec, SpecError, parse_manifest

from . import builders, metrics
from .apply import Applier, JobRecord
from .cluster_cache import ClusterCache
from .job_queue import JobQueue
from .kube_api import ObjectConflict
from .observe import observe_coordinator, observe_workers
from .rebuild import rebuild_state

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, job name)
# Node changes are gathered into one re-plan until none came for NODE_QUIET_S, for at most
# NODE_SETTLE_S after the first (see ``request_settled``).
NODE_QUIET_S = 0.2
NODE_SETTLE_S = 1.0
# A pass runs at least this often (the heartbeat).
HEARTBEAT_S = 10.0
# The heartbeat lists the job's pods and nodes in full at most this often
# (``Reconciler._resync``): at 1,024 pods and 2,000 nodes a list costs this process 2-3 s
# of CPU, which every 10 s competed with the re-plans. What a watch misses waits this long
# at most; a lost worker does not, as the coordinator reports it.
RELIST_S = 60.0


class Reconciler:
    def __init__(self, api: client.ApiClient, settings: core.Settings = core.Settings(),
                 clock: Callable[[], float] = time.time,
                 coordinator_port: int = builders.COORDINATOR_PORT):
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.settings = settings
        self.clock = clock
        self.cache = ClusterCache(self.core)
        self.queue = JobQueue(self.reconcile)
        self.applier = Applier(self.core, self.custom, client.PolicyV1Api(api), clock,
                               coordinator_port)
        self.jobs: dict[Key, JobRecord] = {}
        self._jobs_guard = threading.Lock()

    # --- entry points (the kopf handlers) ------------------------------------------------

    def request(self, namespace: str, name: str) -> None:
        """Reconcile now, or once more right after the pass already running for this job."""
        self.queue.request(namespace, name)

    def request_settled(self, namespace: str, name: str) -> None:
        """Reconcile once node changes pause for ``NODE_QUIET_S``, at most ``NODE_SETTLE_S``
        after the first: a reclaim takes many nodes within a second, and the API server
        delivers their deletions over its course (on a loaded control plane, a second or
        more for 52 nodes, with pauses of 0.3 s: bench_operator_replan.py). A pass on the
        first few would publish a plan that still holds the others, and its pod
        replacements would hold back the plan without them by seconds; one plan for all of
        them is what training can use. So every other request for the job waits for that
        pass meanwhile (``JobQueue.request``), and a pass that such changes overtook leaves
        its decisions to the next (``_superseded``)."""
        self.queue.request_when_quiet(namespace, name, NODE_QUIET_S, NODE_SETTLE_S, "settle")

    def node_changed(self, node: dict | None, name: str) -> list[Key]:
        """Update the node cache; the jobs whose workers this change concerns."""
        if not self.cache.node_changed(node, name):
            return []
        return [key for key, job in list(self.jobs.items())
                if job.state is not None and name in job.state.alive]

    def pod_changed(self, pod: dict, deleted: bool) -> bool:
        """Whether a worker or coordinator pod changed in a way the controller reads. A pod
        that wears a job's labels but names no LazarusJob of that name as its owner is no
        reason for a pass: changing it over and over must not keep the operator busy (the
        exact check, by UID, is the observation's)."""
        meta = pod["metadata"]
        labels = meta.get("labels") or {}
        job = (meta.get("namespace", ""), labels.get(JOB_LABEL, ""))
        if not _names_owner(meta, job[1]):
            return False
        return self.cache.pod_changed(job, labels.get(ROLE_LABEL, ""), pod, deleted)

    def state_changed(self, configmap: dict, deleted: bool) -> bool:
        """Whether the job's state (the coordinator's progress, lost workers) changed."""
        meta = configmap["metadata"]
        job = (meta.get("namespace", ""), (meta.get("labels") or {}).get(JOB_LABEL, ""))
        if meta.get("name") != state_configmap_name(job[1]) or not _names_owner(meta, job[1]):
            return False  # not the job's: the pass reads the job's own, by UID
        return self.cache.state_changed(job, None if deleted else configmap.get("data"))

    def forget(self, namespace: str, name: str) -> None:
        with self._jobs_guard:
            self.jobs.pop((namespace, name), None)
        self.queue.forget(namespace, name)
        self.cache.forget((namespace, name))
        metrics.forget(namespace, name)

    # --- one pass ------------------------------------------------------------------------

    def reconcile(self, namespace: str, name: str) -> None:
        started = time.perf_counter()
        key = (namespace, name)
        try:
            body = self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                            name)
        except ApiException as e:
            if e.status == 404:
                self.forget(namespace, name)
                return
            raise
        try:
            _, spec = parse_manifest(body)
        except SpecError:
            return  # the job handler reported it as a condition; nothing can run
        record = self._record(key)
        try:
            self._pass(record, key, body, spec, started)
        except ObjectConflict as e:
            # Nothing of the job runs while a name it needs is someone else's; the
            # heartbeat looks again, two or three requests every HEARTBEAT_S.
            record.state = None
            self.applier.conflict(body, e)
        uid = body["metadata"]["uid"]
        self.queue.request_after(namespace, name, HEARTBEAT_S, "heartbeat",
                                 before=lambda: self._resync(key, uid, record))

    def _pass(self, record: JobRecord, key: Key, body: dict, spec: JobSpec,
              started: float) -> None:
        namespace, name = key
        fresh = record.state is None
        uid = body["metadata"]["uid"]
        if fresh:
            record.state, record.plan_version = rebuild_state(
                self.core, body, spec, self.cache.nodes, self.settings, self.clock)
        state = record.state
        looked = time.monotonic()  # a node change after this is news to the pass
        if fresh:
            self.cache.resync(key, uid)
            record.listed_at = time.monotonic()
        pods = self.cache.pods(key, "worker")
        coordinators = self.cache.pods(key, "coordinator")
        progress, suspects = read_state_configmap(self.cache.state(key, uid))
        obs = observe_workers(pods, self.cache.node_infos(pods), spec, uid, suspects)
        coordinator = observe_coordinator(coordinators, self.cache.node_infos(coordinators), uid)
        observed = time.perf_counter()

        if fresh and state.plan is not None:
            self.applier.record_publication(body, state.plan)
        # Failures first: whether the worker had trained decides what its node's loss means.
        events: list[core.Event] = [*record.new_failures(obs),
                                    *core.observe(state, obs.live, obs.noticed)]
        if fresh or spec != state.spec:
            events.append(core.SpecChanged(spec))
        if progress is not None and _newer(progress, state):
            events.append(progress)
        events.append(core.Tick())
        now = self.clock()
        t0 = time.perf_counter()
        try:
            outcome = core.handle_all(state, events, now)
        except SpecError as e:
            # A change the CRD's CEL rules would have refused (immutable fields).
            self.applier.event(body, "InvalidSpec", str(e), "Warning",
                               f"invalid.{body['metadata']['generation']}")
            return
        solved = time.perf_counter() - t0
        metrics.SOLVER_SECONDS.labels(namespace, name).observe(solved)
        if self._superseded(record, key, looked, fresh):
            return
        record.told(obs)
        record.looked = looked
        timing = f"observe {observed - started:.3f} s, solve {solved:.3f} s"
        try:
            self.applier.apply(record, body, spec, state, outcome, obs, coordinator, started,
                               timing, lambda: self.queue.changed_since(*key, "settle", looked))
        except Exception:
            record.state = None  # rebuild from the API server next time: it is the truth
            raise
        record.state = outcome.state
        if outcome.retry_at is not None:
            self.queue.request_after(namespace, name, outcome.retry_at - now, "retry")

    def _superseded(self, record: JobRecord, key: Key, looked: float, fresh: bool) -> bool:
        """Whether to leave what this pass decided to the next one, because node changes of
        the job came after it ``looked``: a pass that began just before a reclaim (a fresh
        state's list takes seconds on a loaded control plane) or at a pause in its
        deletions would publish a plan that still holds nodes already gone, and its pods'
        replacements would hold back the plan without them by a second or more. The next
        pass is the one those changes asked for (``request_settled``), due within
        NODE_SETTLE_S. Never twice in a row, so that a steady stream of node changes cannot
        keep a job from ever getting a plan; never a fresh state's pass, whose SpecChanged
        the next pass would not repeat. The pass has written nothing yet: there is nothing
        to undo."""
        superseded = (not fresh and not record.deferred
                      and self.queue.changed_since(*key, "settle", looked))
        record.deferred = superseded
        if superseded:
            log.debug("%s/%s: node changes came during the pass; the next one decides", *key)
        return superseded

    def _resync(self, key: Key, uid: str, record: JobRecord) -> None:
        """The heartbeat's full list of the job's pods, their nodes and its state
        (``ClusterCache.resync``), on the heartbeat's own thread before its pass: in the
        pass it held back the re-plan of a reclaim that came meanwhile by the list's
        length, 3 to 6 s at 2,000 nodes on a loaded control plane (bench_operator_replan.py).
        One at a time per job, at most every RELIST_S, a failed one too (it is logged, and
        the passes go on from what the watches say)."""
        if time.monotonic() - record.listed_at < RELIST_S:
            return
        if not record.listing.acquire(blocking=False):
            return  # the last heartbeat's list is still being read
        try:
            self.cache.resync(key, uid)
        except Exception:  # noqa: BLE001 - see above
            log.warning("%s/%s: could not list the job's pods and nodes", *key, exc_info=True)
        finally:
            record.listed_at = time.monotonic()
            record.listing.release()
        with self._jobs_guard:
            gone = key not in self.jobs
        if gone:  # the job went while its pods were listed: they must not stay cached
            self.cache.forget(key)

    def _record(self, key: Key) -> JobRecord:
        with self._jobs_guard:
            return self.jobs.setdefault(key, JobRecord())


def _names_owner(meta: dict, job: str) -> bool:
    """Whether an object names the LazarusJob ``job`` among its owners."""
    return any(r.get("kind") == KIND and r.get("name") == job
               for r in meta.get("ownerReferences") or [])


def _newer(p: core.Progress, state: core.JobState) -> bool:
    if state.progress_generation is None:
        return True
    return (p.generation, p.step) > (state.progress_generation, state.step)
