"""Reconciling a LazarusJob: observe the cluster, run the controller core, apply its decisions.

Level-triggered: every pass reads the job, its pods and their nodes, turns the difference
from the controller state into events, and applies what the core decides. The state lives
in the API server (the plan ConfigMap and the job's status); the in-memory copy is only a
cache, rebuilt from them after a restart or whenever applying a decision fails. So killing
the operator at any point loses nothing: the next pass re-derives what is missing, pods
have deterministic names, and "already exists" is a normal outcome.

Passes for one job never overlap: events that arrive during a pass coalesce into one more
pass after it (``request``), which keeps a burst of pod events from becoming a burst of
re-plans.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lazarus_core import controller as core
from lazarus_core.job_spec import JobSpec, SpecError, parse_spec
from lazarus_core.plan import Plan, PlanError
from lazarus_core.topology import NodeSpec

from . import builders, metrics
from .observe import NodeInfo, Observation, observe_workers, pod_fingerprint

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, job name)
# How long node changes are gathered before a re-plan (see ``request_settled``).
NODE_SETTLE_S = 0.2
# A pass with a full list of the job's pods and nodes runs at least this often.
RELIST_S = 10.0


@dataclass
class _Job:
    state: core.JobState | None = None
    guard: threading.Lock = field(default_factory=threading.Lock)
    dirty: bool = False
    running: bool = False
    objects_ready: bool = False
    retry: threading.Timer | None = None
    # The job's worker pods as the watch last delivered them (see ``_worker_pods``).
    pods: dict[str, dict] = field(default_factory=dict)
    # resourceVersion of the plan ConfigMap this state was built from or last wrote.
    plan_version: str | None = None
    heartbeat: threading.Timer | None = None
    relist_due: bool = False
    settling: threading.Timer | None = None
    # The newest generation published; stale pod annotations in flight are skipped.
    published: int = 0


class Reconciler:
    def __init__(self, api: client.ApiClient, settings: core.Settings = core.Settings(),
                 clock: Callable[[], float] = time.time,
                 coordinator_port: int = builders.COORDINATOR_PORT):
        self.core = client.CoreV1Api(api)
        self.coordinator_port = coordinator_port
        self.custom = client.CustomObjectsApi(api)
        self.settings = settings
        self.clock = clock
        self.nodes: dict[str, NodeInfo] = {}
        # Nodes the watch saw deleted: known gone without asking the API server (a spot
        # reclaim deletes many at once, and each lookup would delay the re-plan).
        self.gone: set[str] = set()
        self.jobs: dict[Key, _Job] = {}
        self._pod_fingerprints: dict[Key, tuple] = {}
        self._jobs_guard = threading.Lock()
        # Pod creations and deletions fan out, and the pass waits for them; the generation
        # annotations go to their own pool and nobody waits for them.
        self._batch = ThreadPoolExecutor(max_workers=8, thread_name_prefix="lazarus-batch")
        self._background = ThreadPoolExecutor(max_workers=4, thread_name_prefix="lazarus-annotate")

    # --- entry points -------------------------------------------------------------------

    def request(self, namespace: str, name: str) -> None:
        """Reconcile now, or once more right after the pass already running for this job."""
        job = self._job((namespace, name))
        with job.guard:
            job.dirty = True
            if job.running:
                return
            job.running = True
        try:
            while True:
                with job.guard:
                    if not job.dirty:
                        job.running = False
                        return
                    job.dirty = False
                self.reconcile(namespace, name)
        except BaseException:
            with job.guard:
                job.running = False
            raise

    def request_settled(self, namespace: str, name: str) -> None:
        """Reconcile after ``NODE_SETTLE_S``: a reclaim takes many nodes within a fraction of
        a second, and one plan for all of them beats a plan per node. The window starts at
        the first change, so a stream of changes cannot postpone the pass."""
        job = self._job((namespace, name))
        with job.guard:
            if job.settling is not None and job.settling.is_alive():
                return
            job.settling = threading.Timer(NODE_SETTLE_S, self.request, (namespace, name))
            job.settling.daemon = True
            job.settling.start()

    def node_changed(self, node: dict | None, name: str) -> list[Key]:
        """Update the node cache; the jobs whose workers this change concerns."""
        before = self.nodes.get(name)
        after = NodeInfo.from_manifest(node) if node is not None else None
        if after is None:
            self.nodes.pop(name, None)
            self.gone.add(name)
        else:
            self.nodes[name] = after
            self.gone.discard(name)
        if before is not None and after is not None and (before.ready, before.taints) == (
                after.ready, after.taints):
            return []
        return [key for key, job in list(self.jobs.items())
                if job.state is not None and name in job.state.alive]

    def pod_changed(self, pod: dict, deleted: bool) -> bool:
        """Whether a worker pod changed in a way the controller reads (not, for example, the
        operator's own generation annotation: hundreds of those must not trigger re-plans)."""
        meta = pod["metadata"]
        key = (meta.get("namespace", ""), meta["name"])
        job = self._job((key[0], (meta.get("labels") or {}).get(builders.JOB_LABEL, "")))
        if deleted:
            job.pods.pop(key[1], None)
            self._pod_fingerprints.pop(key, None)
            return True
        job.pods[key[1]] = pod
        fingerprint = pod_fingerprint(pod)
        if self._pod_fingerprints.get(key) == fingerprint:
            return False
        self._pod_fingerprints[key] = fingerprint
        return True

    def forget(self, namespace: str, name: str) -> None:
        with self._jobs_guard:
            job = self.jobs.pop((namespace, name), None)
        for timer in (job.retry, job.settling, job.heartbeat) if job is not None else ():
            if timer is not None:
                timer.cancel()
        metrics.forget(namespace, name)

    # --- one pass -----------------------------------------------------------------------

    def reconcile(self, namespace: str, name: str) -> None:
        started = time.perf_counter()
        try:
            body = self.custom.get_namespaced_custom_object(
                builders.GROUP, builders.VERSION, namespace, builders.PLURAL, name)
        except ApiException as e:
            if e.status == 404:
                self.forget(namespace, name)
                return
            raise
        try:
            spec = parse_spec(body.get("spec"))
        except SpecError:
            return  # the job handler reported it as a condition; nothing can run
        job = self._job((namespace, name))
        fresh = job.state is None
        state = job.state or self._rebuild(body, spec)
        pods = self._worker_pods(job, namespace, name, fresh)
        obs = observe_workers(pods, self._node_infos(pods), spec)
        observed = time.perf_counter()

        if fresh and state.plan is not None:
            self._record_publication(body, state.plan)
        events: list[core.Event] = core.observe(state, obs.live, obs.noticed)
        if fresh or spec != state.spec:
            events.append(core.SpecChanged(spec))
        if obs.progress is not None and _newer(obs.progress, state):
            events.append(obs.progress)
        events.append(core.Tick())
        now = self.clock()
        t0 = time.perf_counter()
        try:
            outcome = core.handle_all(state, events, now)
        except SpecError as e:
            # A change the CRD's CEL rules would have refused (immutable fields).
            self._event(body, "InvalidSpec", str(e), "Warning", f"invalid.{body['metadata']['generation']}")
            return
        solved = time.perf_counter() - t0
        metrics.SOLVER_SECONDS.labels(namespace, name).observe(solved)
        timing = f"observe {observed - started:.3f} s, solve {solved:.3f} s"
        try:
            self._apply(body, spec, outcome, obs, started, timing)
        except Exception:
            job.state = None  # rebuild from the API server next time: it is the truth
            raise
        job.state = outcome.state
        if outcome.retry_at is not None:
            self._retry(job, namespace, name, outcome.retry_at - now)
        self._schedule_heartbeat(job, namespace, name)

    def _relist(self, job: _Job, namespace: str, name: str) -> None:
        job.relist_due = True
        self.request(namespace, name)

    def _schedule_heartbeat(self, job: _Job, namespace: str, name: str) -> None:
        """A pass every ``RELIST_S`` even without events: a watch can miss a deletion (for
        example while this replica was paused by peering), and the periodic full list
        catches it. Passes are level-triggered, so an extra one is harmless."""
        if job.heartbeat is not None:
            job.heartbeat.cancel()
        job.heartbeat = threading.Timer(RELIST_S, self._relist, (job, namespace, name))
        job.heartbeat.daemon = True
        job.heartbeat.start()

    def _retry(self, job: _Job, namespace: str, name: str, delay: float) -> None:
        """Reconcile again after ``delay`` seconds (a deadline the core asked for)."""
        if job.retry is not None:
            job.retry.cancel()
        job.retry = threading.Timer(max(0.0, delay), self.request, (namespace, name))
        job.retry.daemon = True
        job.retry.start()

    def _apply(self, body: dict, spec: JobSpec, outcome: core.Outcome, obs: Observation,
               started: float, timing: str) -> None:
        namespace = body["metadata"]["namespace"]
        state = outcome.state
        restores = {d.generation: d for d in outcome.decisions
                    if isinstance(d, core.RestoreCheckpoint)}
        self._ensure_job_objects(body, spec)
        for d in outcome.decisions:
            if isinstance(d, core.PublishPlan):
                self._publish(body, d, restores.get(d.plan.generation), state.draining, obs,
                              started, timing)
            elif isinstance(d, core.ReleaseWorkers):
                self._delete_pods([(obs.pod_on[n], False) for n in d.names if n in obs.pod_on],
                                  namespace)
            elif isinstance(d, core.Wait):
                generation = state.plan.generation if state.plan else 0
                self._event(body, d.reason, d.message, "Warning",
                            f"g{generation}.{d.reason.lower()}")
        if not state.finished:  # a finished job's pods stay, with their logs
            self._delete_pods(obs.doomed, namespace)
        self._right_size(body, spec, state, obs)
        self._patch_status(body, state)

    def _publish(self, body: dict, d: core.PublishPlan, restore: core.RestoreCheckpoint | None,
                 draining: frozenset[str],
                 obs: Observation, started: float, timing: str) -> None:
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        plan = d.plan
        restore_doc = None if restore is None else {
            "generation": restore.generation, "step": restore.step,
            "lost": [list(x) for x in restore.lost]}
        cm = builders.build_plan_configmap(name, namespace, plan, restore_doc,
                                           tuple(draining))
        kopf.adopt(cm, owner=body)
        self._write_plan(self._job((namespace, name)), cm)
        elapsed = time.perf_counter() - started
        labels = (namespace, name)
        if plan.generation > 1:
            metrics.RECONFIGURATIONS.labels(*labels, plan.reason).inc()
            metrics.RECONFIGURATION_SECONDS.labels(*labels).observe(elapsed)
        if d.migration is not None:
            metrics.EXPERTS_MIGRATED.labels(*labels).inc(d.migration.experts_migrated)
        metrics.PLAN_GENERATION.labels(*labels).set(plan.generation)
        for k, p in plan.recovery.items():
            metrics.RECOVERY_PROBABILITY.labels(*labels, k).set(p)
        log.info("%s/%s: %s (published in %.3f s: %s)", namespace, name, d.message, elapsed, timing)
        self._event(body, "PlanPublished" if plan.generation == 1 else "Reconfigured",
                    d.message, "Normal", f"g{plan.generation}.published")
        if restore is not None:
            metrics.CHECKPOINT_RESTORES.labels(*labels).inc()
            self._event(body, "CheckpointRestore", restore.message, "Warning",
                        f"g{plan.generation}.restore")
        # The ConfigMap is the plan; the pod annotation lets `kubectl get pods` show which
        # generation each worker was last told about. It is informational, so it fans out in
        # the background: hundreds of pod patches must not delay the next re-plan.
        job = self._job((namespace, name))
        job.published = plan.generation
        patch = {"metadata": {"annotations": {builders.GENERATION_ANNOTATION: str(plan.generation)}}}

        def annotate(pod: str) -> None:
            if job.published != plan.generation:
                return  # a newer generation is out; its own fan-out covers this pod
            try:
                self._ignore_missing(self.core.patch_namespaced_pod, pod, namespace, patch)
            except ApiException as e:
                log.warning("could not annotate %s/%s: %s", namespace, pod, e.reason)

        for pod in (obs.pod_on[n.name] for n in plan.nodes if n.name in obs.pod_on):
            self._background.submit(annotate, pod)

    def _record_publication(self, body: dict, plan: Plan) -> None:
        """The Event of the latest generation, in case an operator died between writing the
        plan and posting it (the Event's name is fixed, so a posted one is not repeated)."""
        self._event(body, "PlanPublished" if plan.generation == 1 else "Reconfigured",
                    f"generation {plan.generation} ({plan.reason}): published by an operator "
                    f"that stopped before recording it; {len(plan.nodes)} nodes",
                    "Normal", f"g{plan.generation}.published")

    def _right_size(self, body: dict, spec: JobSpec, state: core.JobState,
                    obs: Observation) -> None:
        """Create the workers the target still lacks; drop starting ones beyond it."""
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        if state.finished:  # nothing will train on the pods still starting
            self._delete_pods([(p, False) for p in obs.starting], namespace)
            return
        missing = state.missing_workers(len(obs.starting))
        generation = state.plan.generation if state.plan else 0
        free = (i for i in range(10**6) if i not in obs.used_indices)
        pods = [builders.build_worker_pod(name, namespace, spec, next(free), generation,
                                          self.coordinator_port)
                for _ in range(missing)]

        list(self._batch.map(
            lambda pod: self._create_owned(body, self.core.create_namespaced_pod, pod), pods))
        usable = sum(1 for n in state.nodes if n.name not in state.noticed | state.draining)
        excess = usable + len(obs.starting) - spec.target_nodes
        if excess > 0:
            surplus = sorted(obs.starting, key=_index)[-excess:]
            self._delete_pods([(p, False) for p in surplus], namespace)

    def _patch_status(self, body: dict, state: core.JobState) -> None:
        meta = body["metadata"]
        old = body.get("status") or {}
        new = core.status(state, old.get("conditions") or [], _iso(self.clock()),
                          observed_generation=meta.get("generation"))
        new |= {"observedGeneration": meta.get("generation"),
                "selector": builders.selector(meta["name"]),
                "planConfigMap": builders.plan_configmap_name(meta["name"])}
        labels = (meta["namespace"], meta["name"])
        metrics.READY_NODES.labels(*labels).set(new["readyNodes"])
        if "lowestReplicas" in new:
            metrics.LOWEST_REPLICAS.labels(*labels).set(new["lowestReplicas"])
        if all(old.get(k) == v for k, v in new.items()):
            return  # an unchanged status is not written: no event storm on the job
        self.custom.patch_namespaced_custom_object_status(
            builders.GROUP, builders.VERSION, meta["namespace"], builders.PLURAL, meta["name"],
            {"status": new})

    def _worker_pods(self, job: _Job, namespace: str, name: str, fresh: bool) -> list[dict]:
        """The job's pods: from the watch (listing 500 pods costs a re-plan half a second),
        but listed in full on a fresh state and by the heartbeat pass every ``RELIST_S``, so
        the cache can never drift far (a watch event lost, a pause under peering). Passes
        that react to an event never pay for the full list."""
        if fresh or job.relist_due:
            job.relist_due = False
            pods = self._list_json(self.core.list_namespaced_pod, namespace,
                                   label_selector=builders.selector(name))
            job.pods = {p["metadata"]["name"]: p for p in pods}
            self._refresh_nodes(pods)
            return pods
        # Pods this operator created moments ago may not be here yet: creating them again
        # meets "already exists", which is harmless.
        return list(job.pods.values())

    # --- state rebuild ------------------------------------------------------------------

    def _rebuild(self, body: dict, spec: JobSpec) -> core.JobState:
        """The controller state from what the API server holds: the latest published plan
        and the job's status. Loads and pending growth are re-learnt from the workers."""
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        status = body.get("status") or {}
        plan = None
        try:
            cm = self.core.read_namespaced_config_map(builders.plan_configmap_name(name), namespace)
            self._job((namespace, name)).plan_version = cm.metadata.resource_version
            plan = Plan.from_json((cm.data or {})[builders.PLAN_KEY])
        except ApiException as e:
            if e.status != 404:
                raise
            self._job((namespace, name)).plan_version = None
        except (KeyError, PlanError) as e:
            log.error("%s/%s: the plan ConfigMap is unreadable (%s); starting afresh",
                      namespace, name, e)
        nodes: tuple[NodeSpec, ...] = ()
        if plan is not None:
            nodes = tuple(
                self.nodes[n.name].spec(spec) if n.name in self.nodes else
                NodeSpec(n.name, spec.gpus_per_node, spec.slots_per_gpu, n.zone)
                for n in plan.nodes)
        step = status.get("step", 0)
        return core.JobState(
            # The published plan is taken as held: a restart cannot tell a half-done
            # migration from a finished one, and the workers' next report settles it.
            spec=spec, plan=plan, held=plan, nodes=nodes, step=step,
            checkpoint_step=status.get("checkpointStep"),
            last_rebalance_step=step,
            progress_generation=plan.generation if plan is not None and step else None,
            restores=status.get("checkpointRestores", 0),
            # A stall is counted from now: how long the workers went without a step while
            # no operator ran is not known.
            progress_at=self.clock(),
            finished=spec.steps is not None and step >= spec.steps,
            settings=self.settings,
        )

    # --- API helpers --------------------------------------------------------------------

    def _job(self, key: Key) -> _Job:
        with self._jobs_guard:
            return self.jobs.setdefault(key, _Job())

    def _refresh_nodes(self, pods: Iterable[dict]) -> None:
        """Re-read the nodes these pods run on: the node watch may have missed a deletion."""
        names = {(p.get("spec") or {}).get("nodeName") for p in pods} - {None}
        if not names:
            return
        listed = self._list_json(self.core.list_node, resource_version="0")
        present = {n["metadata"]["name"]: n for n in listed}
        for node in names:
            if node in present:
                self.nodes[node] = NodeInfo.from_manifest(present[node])
                self.gone.discard(node)
            else:
                self.nodes.pop(node, None)
                self.gone.add(node)

    def _node_infos(self, pods: Iterable[dict]) -> dict[str, NodeInfo | None]:
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

    @staticmethod
    def _list_json(fn, *args, **kwargs) -> list[dict]:
        # Raw JSON: the client's model deserialisation costs seconds for a thousand pods.
        return json.loads(fn(*args, _preload_content=False, **kwargs).data)["items"]

    def _write_plan(self, job: _Job, cm: dict) -> None:
        """Write the plan ConfigMap only over the version this state was built from.

        If anyone else wrote it meanwhile (a replica that was active while this one was
        paused, or one still stopping), the write fails with a conflict, the pass is
        abandoned and the next one rebuilds from the ConfigMap: two operators can never
        publish two different plans under one generation number."""
        meta = cm["metadata"]
        if job.plan_version is None:
            written = self.core.create_namespaced_config_map(meta["namespace"], cm)
        else:
            meta["resourceVersion"] = job.plan_version
            written = self.core.replace_namespaced_config_map(meta["name"], meta["namespace"], cm)
        job.plan_version = written.metadata.resource_version

    def _ensure_job_objects(self, body: dict, spec: JobSpec) -> None:
        """The workers' Service, and the coordinator's pod and Service: created once per job
        ("already exists" after an operator restart is the normal case)."""
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        job = self._job((namespace, name))
        if job.objects_ready:
            return
        port = self.coordinator_port
        self._create_owned(body, self.core.create_namespaced_service,
                           builders.build_workers_service(name, namespace))
        self._create_owned(body, self.core.create_namespaced_service,
                           builders.build_coordinator_service(name, namespace, port))
        self._create_owned(body, self.core.create_namespaced_pod,
                           builders.build_coordinator_pod(name, namespace, spec, port))
        job.objects_ready = True

    @staticmethod
    def _create_owned(body: dict, create, obj: dict) -> None:
        """Create ``obj`` owned by the job; one a pass before a restart created is kept."""
        kopf.adopt(obj, owner=body)
        try:
            create(obj["metadata"]["namespace"], obj)
        except ApiException as e:
            if e.status != 409:
                raise

    def _delete_pods(self, pods: list[tuple[str, bool]], namespace: str) -> None:
        def delete(item):
            pod, force = item
            # No kubelet will confirm deleting a pod on a vanished or dead node: force it,
            # so its name and its place in the count are free at once.
            self._ignore_missing(self.core.delete_namespaced_pod, pod, namespace,
                                 grace_period_seconds=0 if force else None)
        list(self._batch.map(delete, pods))

    @staticmethod
    def _ignore_missing(fn, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except ApiException as e:
            if e.status != 404:
                raise

    def _event(self, body: dict, reason: str, message: str, kind: str, suffix: str) -> None:
        """One Event per (job, suffix): a retried pass does not post it twice."""
        meta = body["metadata"]
        ref = {"name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"]}
        name = f"{meta['name']}.{meta['uid'][:8]}.{suffix}"
        event = builders.build_event(ref, reason, message, kind, _iso(self.clock()), name)
        try:
            self.core.create_namespaced_event(meta["namespace"], event)
        except ApiException as e:
            if e.status != 409:
                log.warning("could not post event %s: %s", reason, e.reason)


def _newer(p: core.Progress, state: core.JobState) -> bool:
    if state.progress_generation is None:
        return True
    return (p.generation, p.step) > (state.progress_generation, state.step)


def _index(pod_name: str) -> int:
    tail = pod_name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
