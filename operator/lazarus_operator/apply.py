"""Carrying out the controller's decisions on the API server, and writing the job's status.

Everything here is idempotent: objects have deterministic names, "already exists" is a
normal outcome, and an Event is posted once per (job, generation, kind), so a pass that is
retried, or run again by an operator that restarted half-way, does no harm.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lazarus_core import controller as core
from lazarus_core.cluster_contract import GROUP, PLURAL, VERSION
from lazarus_core.job_spec import JobSpec
from lazarus_core.process_env import new_job_key

from . import builders, metrics
from .kube_api import (ObjectConflict, create_owned, delete_pods, ignore_missing, post_event,
                       rfc3339, write_plan)
from .observe import CoordinatorObservation, Observation

log = logging.getLogger(__name__)

# Worker pods are created in batches that double from one while they succeed, as Kubernetes'
# ReplicaSet controller does, and at most this many are starting at a time: a pod the API
# server refuses costs one request, not one per missing worker, and a job far below its
# target (maxNodes 10000 and no replicas) adds pods as they start running, not 10,000 in one
# pass. Pending pods are what a cluster autoscaler provisions nodes for, so some must exist.
MAX_STARTING_PODS = 100
# How long a published plan stands before its pods get its generation annotation.
ANNOTATE_AFTER_S = 2.0
# How long a worker pod this operator created counts as starting before the pods it
# observes show it: past that it is taken as deleted before the watch saw it.
UNSEEN_FOR_S = 30.0


@dataclass
class JobRecord:
    """What the operator remembers of a job between passes (a cache of the API server)."""
    state: core.JobState | None = None
    objects_ready: bool = False
    # The name of the job's key Secret (the API server picks it; status.keySecret keeps it).
    key_secret: str | None = None
    # Worker indices whose pod name is taken by a pod that is not the job's.
    foreign_indices: set[int] = field(default_factory=set)
    # Worker pods created but not yet in an observation: index -> when (time.monotonic()).
    # On a loaded control plane the watch shows a pass's creations late; without these the
    # next pass took them as missing and sent the same creations again (answered 409).
    unseen: dict[int, float] = field(default_factory=dict)
    # resourceVersion of the plan ConfigMap the state was built from or last wrote.
    plan_version: str | None = None
    # The newest generation published; stale pod annotations in flight are skipped.
    published: int = 0
    # Failed worker pods (uids) already told to the controller, so each counts once.
    failures_seen: set[str] = field(default_factory=set)
    # Whether the last pass left its decisions to the next (``Reconciler._superseded``).
    deferred: bool = False
    # Whether the last pass that acted left its pods and status to the next (``Applier.apply``).
    yielded: bool = False
    # When the last pass that acted began to look at the cluster (``time.monotonic()``).
    looked: float = 0.0
    # Held while the heartbeat lists the job's pods and nodes (``Reconciler._resync``), and
    # when the last list ended (``time.monotonic()``).
    listing: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    listed_at: float = -math.inf

    def new_failures(self, obs: Observation) -> list[core.WorkerFailed]:
        """The failures in ``obs`` not yet told to the controller."""
        return [core.WorkerFailed(node, why) for uid, node, why in obs.failed
                if uid not in self.failures_seen]

    def told(self, obs: Observation) -> None:
        """What the controller made of ``obs`` is being applied: its failures are counted, and
        not told again. (A pass that leaves its decisions to the next does not call this.)"""
        self.failures_seen.update(uid for uid, _, _ in obs.failed)


class Applier:
    def __init__(self, api: client.CoreV1Api, custom: client.CustomObjectsApi,
                 policy: client.PolicyV1Api, clock: Callable[[], float], coordinator_port: int):
        self.core = api
        self.custom = custom
        self.policy = policy
        self.rbac = client.RbacAuthorizationV1Api(api.api_client)
        self.networking = client.NetworkingV1Api(api.api_client)
        self.clock = clock
        self.coordinator_port = coordinator_port
        # Pod creations and deletions fan out, and the pass waits for them; the generation
        # annotations go to their own pool and nobody waits for them.
        self._batch = ThreadPoolExecutor(max_workers=8, thread_name_prefix="lazarus-batch")
        self._background = ThreadPoolExecutor(max_workers=4, thread_name_prefix="lazarus-annotate")

    def apply(self, record: JobRecord, body: dict, spec: JobSpec, before: core.JobState,
              outcome: core.Outcome, obs: Observation, coordinator: CoordinatorObservation,
              started: float, timing: str,
              overtaken: Callable[[], bool] = lambda: False) -> None:
        """Carry out what the controller decided. ``overtaken`` says whether node changes
        came that this pass did not see: a pass is due for them, training waits for its
        plan, and passes never overlap, so what that pass redoes from what it sees (the pods
        to delete, the workers to create, the status) is left to it. Never twice in a row,
        so that node changes that never stop cannot keep a job from its pods (as
        ``Reconciler._superseded`` for its plans)."""
        namespace = body["metadata"]["namespace"]
        state = outcome.state
        self._ensure_job_objects(record, body)
        self._keep_coordinator(record, body, spec, state, coordinator)
        for d in outcome.decisions:
            if isinstance(d, core.PublishPlan):
                self._publish(record, body, d, state.draining, obs, started, timing,
                              overtaken)
            elif isinstance(d, core.ReleaseWorkers):
                delete_pods(self.core, self._batch,
                            [(obs.pod_on[n], False) for n in d.names if n in obs.pod_on],
                            namespace)
            elif isinstance(d, core.Wait):
                generation = state.plan.generation if state.plan else 0
                self.event(body, d.reason, d.message, "Warning",
                           f"g{generation}.{d.reason.lower()}")
        self._report_measured(body, before, state)
        self._report_checkpoint_health(body, before, state)
        if state.start_failures > before.start_failures:
            self.event(body, "WorkerStartFailed",
                       f"a worker failed before completing a step ({state.start_error}); "
                       f"the next one starts after a backoff", "Warning",
                       f"start-failed.{state.start_failures}")
        may_yield, record.yielded = not record.yielded, False

        def yielding() -> bool:
            record.yielded = may_yield and overtaken()
            return record.yielded

        if yielding():
            # After a reclaim these took 8.7 s at 2,000 nodes on a loaded control plane (52
            # pods deleted 3.2 s, 48 created 4.4 s, the status 1.0 s), all of it before
            # the next pass could begin.
            return
        if not state.finished:  # a finished job's pods stay, with their logs
            delete_pods(self.core, self._batch, obs.doomed, namespace)
        self._right_size(record, body, spec, state, obs, yielding)
        self._patch_status(body, state)

    def record_publication(self, body: dict, plan) -> None:
        """The Event of the latest generation, in case an operator died between writing the
        plan and posting it (the Event's name is fixed, so a posted one is not repeated)."""
        self.event(body, "PlanPublished" if plan.generation == 1 else "Reconfigured",
                   f"generation {plan.generation} ({plan.reason}): published by an operator "
                   f"that stopped before recording it; {len(plan.nodes)} nodes",
                   "Normal", f"g{plan.generation}.published")

    def event(self, body: dict, reason: str, message: str, kind: str, suffix: str) -> None:
        post_event(self.core, body, reason, message, kind, suffix, self.clock())

    def conflict(self, body: dict, e: ObjectConflict) -> None:
        """The job cannot go on: Ready=False naming the object in the way (written once,
        not again while it reads the same), and one Event."""
        meta = body["metadata"]
        old = (body.get("status") or {}).get("conditions") or []
        ready = next((c for c in old if c.get("type") == "Ready"), {})
        if (ready.get("reason"), ready.get("message")) == ("NameConflict", str(e)):
            return
        log.warning("%s/%s: %s", meta["namespace"], meta["name"], e)
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, meta["namespace"], PLURAL, meta["name"], {"status": {
                "conditions": core.not_ready(old, "NameConflict", str(e),
                                             rfc3339(self.clock()), meta.get("generation"))}})
        self.event(body, "NameConflict", str(e), "Warning",
                   f"conflict.{e.kind.lower()}.{e.name}")

    # --- decisions -----------------------------------------------------------------------

    def _publish(self, record: JobRecord, body: dict, d: core.PublishPlan,
                 draining: frozenset[str], obs: Observation, started: float,
                 timing: str, overtaken: Callable[[], bool]) -> None:
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        plan = d.plan
        writing = time.perf_counter()
        cm = builders.build_plan_configmap(name, namespace, plan, tuple(draining))
        kopf.adopt(cm, owner=body)
        record.plan_version = write_plan(self.core, cm, record.plan_version)
        elapsed = time.perf_counter() - started
        timing += f", write {time.perf_counter() - writing:.3f} s"
        labels = (namespace, name)
        if plan.generation > 1:
            metrics.RECONFIGURATIONS.labels(*labels, plan.reason).inc()
            metrics.RECONFIGURATION_SECONDS.labels(*labels).observe(elapsed)
        metrics.PLAN_GENERATION.labels(*labels).set(plan.generation)
        for k, p in plan.recovery.items():
            metrics.RECOVERY_PROBABILITY.labels(*labels, k).set(p)
        log.info("%s/%s: %s (published in %.3f s: %s)", namespace, name, d.message, elapsed,
                 timing)
        self.event(body, "PlanPublished" if plan.generation == 1 else "Reconfigured",
                   d.message, "Normal", f"g{plan.generation}.published")
        # The ConfigMap is the plan; the pod annotation lets `kubectl get pods` show which
        # generation each worker was last told about. It is informational, so it fans out
        # in the background, and only once the plan has stood for ANNOTATE_AFTER_S: a
        # thousand pod patches cost seconds of this process's CPU, and during a reclaim
        # they held back the watch events and the re-plan of the nodes lost next. For the
        # same reason they stop once node changes come (``overtaken``): a new generation is
        # due, and its own fan-out covers the pods (at 2,000 nodes, 1,024 patches after a
        # growth were still going when the next reclaim came, bench_operator_replan.py).
        # The closures below hold the generation, not the plan: a thousand queued patches
        # would otherwise keep a plan of every recent generation alive.
        generation = record.published = plan.generation
        patch = {"metadata": {"annotations": {
            builders.GENERATION_ANNOTATION: str(generation)}}}
        pods = [obs.pod_on[n.name] for n in plan.nodes if n.name in obs.pod_on]

        def annotate(pod: str) -> None:
            if record.published != generation or overtaken():
                return  # a newer generation is out or due; its own fan-out covers this pod
            try:
                ignore_missing(self.core.patch_namespaced_pod, pod, namespace, patch)
            except ApiException as e:
                log.warning("could not annotate %s/%s: %s", namespace, pod, e.reason)

        def fan_out() -> None:
            if record.published == generation and not overtaken():
                for pod in pods:
                    self._background.submit(annotate, pod)

        timer = threading.Timer(ANNOTATE_AFTER_S, fan_out)
        timer.daemon = True
        timer.start()

    def _report_measured(self, body: dict, before: core.JobState,
                         state: core.JobState) -> None:
        """Metrics and Events for what the workers did to adopt a generation, once, when
        the first progress report under it arrives."""
        g = state.progress_generation
        if g is None or g == before.progress_generation:
            return
        labels = (body["metadata"]["namespace"], body["metadata"]["name"])
        metrics.EXPERTS_MIGRATED.labels(*labels).inc(state.experts_migrated)
        if state.restored_step is not None:
            metrics.CHECKPOINT_RESTORES.labels(*labels).inc()
            self.event(body, "CheckpointRestore",
                       f"generation {g}: {state.experts_lost} (layer, expert) pairs had lost "
                       f"every replica; the workers restored the checkpoint of step "
                       f"{state.restored_step}", "Warning", f"g{g}.restore")

    def _report_checkpoint_health(self, body: dict, before: core.JobState,
                                  state: core.JobState) -> None:
        """A metric for every checkpoint the workers skipped, and an Event when checkpoints
        start failing and when they are written again."""
        labels = (body["metadata"]["namespace"], body["metadata"]["name"])
        if state.spec.checkpoint is None:
            return
        metrics.CHECKPOINT_HEALTHY.labels(*labels).set(state.checkpoint_error is None)
        skipped = state.checkpoint_failures - before.checkpoint_failures
        if skipped > 0:
            metrics.CHECKPOINT_WRITE_FAILURES.labels(*labels).inc(skipped)
        if state.checkpoint_error is not None and before.checkpoint_error is None:
            self.event(body, "CheckpointWriteFailed",
                       f"{state.checkpoint_error}; training goes on", "Warning",
                       f"checkpoint-failed.{state.checkpoint_failures}")
        elif state.checkpoint_error is None and before.checkpoint_error is not None:
            self.event(body, "CheckpointWritten",
                       f"checkpoints are written again (step {state.checkpoint_step}) after "
                       f"{state.checkpoint_failures} were skipped", "Normal",
                       f"checkpoint-healed.{state.checkpoint_failures}")

    def _right_size(self, record: JobRecord, body: dict, spec: JobSpec, state: core.JobState,
                    obs: Observation, yielding: Callable[[], bool]) -> None:
        """Create the workers the target still lacks; drop starting ones beyond it.

        Once the pass is ``yielding`` (see ``apply``), no further batch is created: on a
        loaded control plane the batches of a reclaim's replacements take seconds, and the
        pass the new node changes asked for, whose plan training waits for, cannot begin
        before this one ends (bench_operator_replan.py at 2,000 nodes: the last 6 of 52 deletions
        waited 6 s for 48 replacements). That pass creates what is still missing."""
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        if state.finished:  # nothing will train on the pods still starting
            delete_pods(self.core, self._batch, [(p, False) for p in obs.starting], namespace)
            return
        now = time.monotonic()
        record.unseen = {i: at for i, at in record.unseen.items()
                         if i not in obs.used_indices and now - at < UNSEEN_FOR_S}
        starting = len(obs.starting) + len(record.unseen)
        missing = min(state.missing_workers(starting, self.clock()),
                      max(0, MAX_STARTING_PODS - starting))
        generation = state.plan.generation if state.plan else 0
        free = (i for i in range(10**6) if i not in obs.used_indices
                and i not in record.foreign_indices and i not in record.unseen)
        uid = body["metadata"]["uid"]

        def create(pod: dict) -> bool:
            index = int(pod["metadata"]["labels"][builders.INDEX_LABEL])
            try:
                create_owned(body, self.core.create_namespaced_pod,
                             self.core.read_namespaced_pod, pod)
            except ObjectConflict as e:
                # A pod of that name that is not the job's: never adopted, its name skipped.
                record.foreign_indices.add(index)
                self.event(body, "NameConflict", str(e), "Warning",
                           f"conflict.pod.{pod['metadata']['name']}")
                return False
            record.unseen[index] = time.monotonic()
            return True

        created, batch = 0, 1
        while created < missing:
            pods = [builders.build_worker_pod(name, namespace, spec, next(free), generation,
                                              record.key_secret, self.coordinator_port,
                                              job_uid=uid)
                    for _ in range(min(batch, missing - created))]
            done = list(self._batch.map(create, pods))
            created += sum(done)
            if not all(done) or yielding():
                break
            batch *= 2
        usable = sum(1 for n in state.nodes if n.name not in state.noticed | state.draining)
        excess = usable + len(obs.starting) - spec.target_nodes
        if excess > 0:
            surplus = sorted(obs.starting, key=_index)[-excess:]
            delete_pods(self.core, self._batch, [(p, False) for p in surplus], namespace)

    def _ensure_job_objects(self, record: JobRecord, body: dict) -> None:
        """The job's key Secret, its NetworkPolicy, the coordinator's ServiceAccount, Role
        and RoleBinding, the workers' Service, the coordinator's Service and disruption
        budget, and the job's state ConfigMap: created once per job ("already exists" after
        an operator restart is the normal case, and the object is kept if the job owns it)."""
        if record.objects_ready:
            return
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        if record.key_secret is None:
            record.key_secret = ((body.get("status") or {}).get("keySecret")
                                 or self._new_key_secret(body))
        calls = {  # kind: (create, read)
            "NetworkPolicy": (self.networking.create_namespaced_network_policy,
                              self.networking.read_namespaced_network_policy),
            "ServiceAccount": (self.core.create_namespaced_service_account,
                               self.core.read_namespaced_service_account),
            "Role": (self.rbac.create_namespaced_role, self.rbac.read_namespaced_role),
            "RoleBinding": (self.rbac.create_namespaced_role_binding,
                            self.rbac.read_namespaced_role_binding),
            "Service": (self.core.create_namespaced_service, self.core.read_namespaced_service),
            "PodDisruptionBudget": (self.policy.create_namespaced_pod_disruption_budget,
                                    self.policy.read_namespaced_pod_disruption_budget),
            "ConfigMap": (self.core.create_namespaced_config_map,
                          self.core.read_namespaced_config_map)}
        # The policy and the coordinator's account first: nothing runs before what confines
        # it exists, and an object in the way (ObjectConflict) stops the pass before any pod
        # is made (the coordinator's pod is ``_keep_coordinator``'s).
        for obj in (builders.build_network_policy(name, namespace),
                    *builders.build_coordinator_access(name, namespace),
                    builders.build_workers_service(name, namespace),
                    builders.build_coordinator_service(name, namespace, self.coordinator_port),
                    builders.build_coordinator_pdb(name, namespace),
                    builders.build_state_configmap(name, namespace)):
            create_owned(body, *calls[obj["kind"]], obj)
        record.objects_ready = True

    def _new_key_secret(self, body: dict) -> str:
        """A fresh key in a Secret of its own, its name kept in the job's status at once,
        before any pod refers to it: a pass that starts again after a crash finds it there,
        so the job's pods never get two different keys. (A crash between the two calls
        leaves a Secret no pod uses; the job owns it, so it goes with the job.)"""
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        secret = builders.build_key_secret(name, namespace, new_job_key())
        kopf.adopt(secret, owner=body)
        created = self.core.create_namespaced_secret(namespace, secret).metadata.name
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": {"keySecret": created}})
        return created

    def _keep_coordinator(self, record: JobRecord, body: dict, spec: JobSpec,
                          state: core.JobState, coordinator: CoordinatorObservation) -> None:
        """One coordinator lives while the job trains: a dead one (its process exited, its
        pod was deleted, its node is gone) is cleaned up and the next incarnation started;
        it carries on from the job's state ConfigMap and what the workers hold."""
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        if coordinator.finished or state.finished:
            return  # the job is done: its pods stay, with their logs
        delete_pods(self.core, self._batch, coordinator.doomed, namespace)
        if coordinator.alive:
            return
        create_owned(body, self.core.create_namespaced_pod, self.core.read_namespaced_pod,
                     builders.build_coordinator_pod(name, namespace, spec, record.key_secret,
                                                    coordinator.next_index,
                                                    self.coordinator_port,
                                                    job_uid=body["metadata"]["uid"]))
        if coordinator.next_index > 0:
            metrics.COORDINATOR_REPLACEMENTS.labels(namespace, name).inc()
            self.event(body, "CoordinatorReplaced",
                       f"the coordinator is gone; started incarnation "
                       f"{coordinator.next_index}, which carries on from the job's state and "
                       f"what the workers hold", "Warning",
                       f"coordinator.{coordinator.next_index}")

    # --- status --------------------------------------------------------------------------

    def _patch_status(self, body: dict, state: core.JobState) -> None:
        meta = body["metadata"]
        old = body.get("status") or {}
        new = core.status(state, old.get("conditions") or [], rfc3339(self.clock()),
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
            GROUP, VERSION, meta["namespace"], PLURAL, meta["name"], {"status": new})


def _index(pod_name: str) -> int:
    tail = pod_name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1
