"""The coordinator of a LazarusJob on Kubernetes, in the pod the operator creates for it:

    python -m lazarus_runtime.cluster_coordinator   (configured by the environment, see main)

It owns the workers' rendezvous store, so it runs apart from them, on reliable capacity: a
lost worker never takes the store with it. It follows the plans the operator publishes in
the job's plan ConfigMap and drives the workers through them with the local backend's
StepCoordinator. A plan that drops a live member's node (a failure) is published at once,
and the step in flight is redone; any other change (growth, a spot notice, a rebalance)
waits for the next step boundary, so no step is lost. Progress goes where the operator
reads it: an annotation on the pod of rank 0. One JSON line per event goes to stdout.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist
from kubernetes import client, config, watch
from lazarus_core import process_env as penv
from lazarus_core.cluster_contract import (JOB_LABEL, PROGRESS_ANNOTATION, ROLE_LABEL,
                                           progress_json, read_plan_configmap)
from lazarus_core.controller import STALLED, Progress
from lazarus_core.plan import Plan, PlanError

from .coordination import PreparedStep, StepCoordinator
from .job_channel import JobChannel

log = logging.getLogger("lazarus.coordinator")


@dataclass(frozen=True)
class Published:
    """One generation as the operator published it."""
    plan: Plan
    draining: frozenset[str]

    @property
    def alive(self) -> set[str]:
        """Nodes whose workers the operator counts as running."""
        return {n.name for n in self.plan.nodes} | self.draining


class PlanFollower:
    """The newest plan in the job's ConfigMap, kept current by a watch thread."""

    def __init__(self, core: client.CoreV1Api, namespace: str, name: str):
        self.core, self.namespace, self.name = core, namespace, name
        self._newest: Published | None = None
        self._lock = threading.Lock()

    def start(self) -> "PlanFollower":
        threading.Thread(target=self._follow, name="plan-follower", daemon=True).start()
        return self

    def newest(self) -> Published | None:
        with self._lock:
            return self._newest

    def _follow(self) -> None:
        while True:
            try:
                for event in watch.Watch().stream(
                        self.core.list_namespaced_config_map, self.namespace,
                        field_selector=f"metadata.name={self.name}", timeout_seconds=300):
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self._take(event["object"].data or {})
            except Exception as e:  # noqa: BLE001 - the API server restarts; follow again
                log.warning("plan watch ended (%s); watching again", e)
                time.sleep(1)

    def _take(self, data: dict) -> None:
        try:
            published = Published(*read_plan_configmap(data))
        except (KeyError, ValueError, PlanError) as e:
            log.error("unreadable plan ConfigMap %s: %s", self.name, e)
            return
        with self._lock:
            if self._newest is None or published.plan.generation > self._newest.plan.generation:
                self._newest = published


class ProgressReporter:
    """Writes the newest progress on the pod of rank 0, off the step loop (a slow API call
    must not hold up training; a report overtaken by a newer one is simply dropped), at
    most every ``MIN_INTERVAL_S``: each write is a pass of the operator over the job."""

    MIN_INTERVAL_S = 0.5

    def __init__(self, core: client.CoreV1Api, namespace: str, job: str):
        self.core, self.namespace, self.job = core, namespace, job
        self._pods: dict[str, str] = {}  # node -> worker pod
        self._latest: tuple[str, dict] | None = None
        self._writing = False
        self._ready = threading.Condition()

    def start(self) -> "ProgressReporter":
        threading.Thread(target=self._write, name="progress", daemon=True).start()
        return self

    def report(self, node: str, progress: Progress) -> None:
        with self._ready:
            self._latest = (node, progress)
            self._ready.notify_all()

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until the latest report is written (the last one, before exiting)."""
        with self._ready:
            self._ready.wait_for(lambda: self._latest is None and not self._writing,
                                 timeout=timeout_s)

    def _write(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._latest is not None)
                node, progress = self._latest
                self._latest = None
                self._writing = True
            try:
                pod = self._pod_on(node)
                if pod is not None:
                    self.core.patch_namespaced_pod(pod, self.namespace, {"metadata": {
                        "annotations": {PROGRESS_ANNOTATION: progress_json(progress)}}})
            except client.ApiException as e:
                self._pods.pop(node, None)  # replaced or gone: look it up again next time
                log.warning("could not report progress on %s's pod: %s", node, e.reason)
            with self._ready:
                self._writing = False
                self._ready.notify_all()
            time.sleep(self.MIN_INTERVAL_S)

    def _pod_on(self, node: str) -> str | None:
        if node not in self._pods:
            pods = self.core.list_namespaced_pod(
                self.namespace, label_selector=f"{JOB_LABEL}={self.job},{ROLE_LABEL}=worker",
                field_selector=f"spec.nodeName={node}").items
            live = [p.metadata.name for p in pods if not p.metadata.deletion_timestamp]
            if not live:
                return None
            self._pods[node] = live[0]
        return self._pods[node]


class ClusterCoordinator:
    def __init__(self, chan: JobChannel, plans: PlanFollower, progress: ProgressReporter,
                 total_steps: int | None = None):
        self.chan = chan
        self.total_steps = total_steps
        self.plans = plans
        self.progress = progress
        # It runs as long as the job: only the last reconfigurations are kept in memory.
        self.steps = StepCoordinator(chan, on_event=lambda line: emit("info", message=line),
                                     keep_reconfigurations=16)
        self.pending: Published | None = None  # the newest plan, not published yet
        self.seen = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            self.tick()
            time.sleep(0.002)
        self.chan.stop()

    def tick(self) -> None:
        """Take the newest plan if it can be published now, then commit a prepared step."""
        self._follow_plans()
        prepared = self.steps.poll()
        if prepared is not None:
            self._complete(prepared)

    def _follow_plans(self) -> None:
        newest = self.plans.newest()
        if newest is not None and newest.plan.generation > self.seen:
            self.seen = newest.plan.generation
            self.pending = newest  # replaces one still waiting for its step boundary
        if self.pending is not None and self._ready(self.pending) and not self._at_boundary(
                self.pending):
            self._publish(self.pending, boundary=None)

    def _complete(self, prepared: PreparedStep) -> None:
        last = self.total_steps is not None and prepared.step >= self.total_steps
        if last:
            self.steps.commit(prepared, last=True)  # the workers apply it and stop
        elif self.pending is not None and self._ready(self.pending):
            self._publish(self.pending, boundary=prepared)
        else:
            self.steps.commit(prepared)
        emit("step", step=prepared.step, generation=prepared.generation, loss=prepared.loss)
        plan = self.steps.directive.plan
        self.progress.report(plan.nodes[0].name, self.steps.progress(prepared))
        if last:
            self.progress.flush()  # the operator learns from it that the job is done
            emit("finished", step=prepared.step)
            self.stopping.set()

    def _ready(self, p: Published) -> bool:
        """Every worker of the plan is up: a plan naming a worker still importing torch
        would hold every survivor at the rendezvous until it arrives."""
        return all(self.chan.said_hello(n.name) for n in p.plan.nodes)

    def _at_boundary(self, p: Published) -> bool:
        """Whether ``p`` can wait for the next step boundary: the current generation is in
        place, every one of its members still runs, and steps are being made (a plan for
        a stalled job has no boundary to wait for)."""
        d = self.steps.directive
        adopted = self.steps.adopted
        return (d is not None and adopted is not None and adopted.generation == d.generation
                and all(n.name in p.alive for n in d.plan.nodes) and p.plan.reason != STALLED)

    def _publish(self, p: Published, boundary: PreparedStep | None) -> None:
        d = self.steps.publish(p.plan, p.alive, boundary=boundary)
        self.pending = None
        emit("plan", generation=p.plan.generation, reason=p.plan.reason,
             workers=p.plan.world_size, boundary=boundary is not None,
             start_step=d.start_step, restored_step=d.restore_step,
             experts_migrated=self.steps.reconfigs[-1].experts_migrated,
             draining=sorted(d.draining))


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, "time": round(time.time(), 4), **fields}), flush=True)


def _kube_config() -> None:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()  # KUBECONFIG: outside a cluster, or a local test kubelet


def main() -> int:
    """Configured by the environment the operator gives the coordinator pod
    (``lazarus_core.process_env``)."""
    try:
        env = penv.read_coordinator_env(os.environ)
    except penv.EnvError as e:
        print(f"lazarus coordinator: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=env.log_level, format="%(asctime)s %(name)s %(message)s")
    _kube_config()
    core = client.CoreV1Api()
    # Its reads never wait for a key, but one (JobChannel.reports) can: this bounds it.
    store = dist.TCPStore("0.0.0.0", env.port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    coordinator = ClusterCoordinator(JobChannel(store, env.key, env.job),
                                     PlanFollower(core, env.namespace, env.plan_configmap).start(),
                                     ProgressReporter(core, env.namespace, env.job).start(),
                                     env.steps)
    # Deleting the job deletes this pod: tell the workers to stop rather than time out.
    signal.signal(signal.SIGTERM, lambda *_: coordinator.stopping.set())
    emit("serving", port=env.port, job=env.job)
    coordinator.run()
    return 0

if __name__ == "__main__":
    sys.exit(main())
