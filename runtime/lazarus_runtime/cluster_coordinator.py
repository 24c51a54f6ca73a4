"""The coordinator of a LazarusJob on Kubernetes, in the pod the operator creates for it:

    python -m lazarus_runtime.cluster_coordinator   (configured by the environment, see main)

It owns the workers' rendezvous store, so it runs apart from them, on reliable capacity: a
lost worker never takes the store with it. It follows the plans the operator publishes in
the job's plan ConfigMap and drives the workers through them with the local backend's
StepCoordinator. A plan that drops a live member's node (a failure) is published at once,
and the step in flight is redone; any other change (growth, a spot notice, a rebalance)
waits for the next step boundary, so no step is lost.

It writes the job's state ConfigMap, off the step loop: its progress report, which is also
the job's durable record (committed step, generation, newest checkpoint, restores), and the
workers it found lost from their heartbeats and their peers' failure reports, long before
Kubernetes would (the operator re-plans without them at once).

It can die and be replaced (the operator starts a new pod): the new one reads that record,
waits for the workers to reconnect and say what they hold, and carries on from there. One
JSON line per event goes to stdout.

Its workers are rank processes, one per GPU, named by node and GPU (``plan.member_name``);
the lost ones it reports by that name, so the operator can drop one GPU of a node.
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
from lazarus_core.cluster_contract import (read_plan_configmap, read_state_configmap,
                                           state_configmap_data)
from lazarus_core.controller import STALLED, Progress
from lazarus_core.plan import Plan, PlanError

from .checkpoint import Checkpoints
from .coordination import PreparedStep, StepCoordinator
from .job_channel import JobChannel

# A replacement coordinator gives the workers of the plan this long to reconnect; those that
# do not are reported lost (their node may have gone with the coordinator's).
RECONNECT_WAIT_S = 10.0
# A worker found lost and silent ever since is forgotten after this long: Kubernetes has long
# seen its node or pod go by then.
FORGET_LOST_S = 600.0
# After the last step the coordinator serves its store until every rank of the plan has
# exited or is lost (they read the stop, and write the last checkpoint, through it), but no
# longer than this: a rank that neither leaves nor goes silent cannot hold the job open.
FINISH_WAIT_S = 300.0

log = logging.getLogger("lazarus.coordinator")


@dataclass(frozen=True)
class Published:
    """One generation as the operator published it."""
    plan: Plan
    draining: frozenset[str]  # nodes

    def alive(self, before: Plan | None) -> set[str]:
        """The rank processes the operator counts as running: the plan's, and those of its
        draining nodes, as ``before`` (the plan they last trained under) placed them."""
        out = set(self.plan.members())
        if before is not None:
            out |= {m for n in before.nodes if n.name in self.draining for m in n.members()}
        return out


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


class StateReporter:
    """Writes the job's state ConfigMap off the step loop (a slow API call must not hold up
    training): the newest progress at most every ``MIN_INTERVAL_S`` (each write is a pass
    of the operator over the job; a report overtaken by a newer one is simply dropped), a
    change of the lost workers at once."""

    MIN_INTERVAL_S = 0.5

    def __init__(self, core: client.CoreV1Api, namespace: str, name: str):
        self.core, self.namespace, self.name = core, namespace, name
        self._progress: Progress | None = None
        self._suspects: dict[str, str] = {}
        # The workers a predecessor had found lost (see ClusterCoordinator._watch_workers).
        self.inherited: dict[str, str] = {}
        self._dirty = False
        self._urgent = False
        self._writing = False
        self._ready = threading.Condition()

    def read(self) -> Progress | None:
        """The durable record a predecessor left (None on a job's first coordinator)."""
        try:
            cm = self.core.read_namespaced_config_map(self.name, self.namespace)
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise
        progress, self.inherited = read_state_configmap(cm.data)
        return progress

    def start(self) -> "StateReporter":
        threading.Thread(target=self._write, name="state", daemon=True).start()
        return self

    def report(self, progress: Progress) -> None:
        with self._ready:
            self._progress, self._dirty = progress, True
            self._ready.notify_all()

    def suspect(self, suspects: dict[str, str]) -> None:
        with self._ready:
            if suspects != self._suspects:
                self._suspects, self._dirty, self._urgent = dict(suspects), True, True
                self._ready.notify_all()

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until the latest report is written (the last one, before exiting)."""
        with self._ready:
            self._ready.wait_for(lambda: not self._dirty and not self._writing,
                                 timeout=timeout_s)

    def _write(self) -> None:
        last = 0.0
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._dirty)
                if not self._urgent:
                    self._ready.wait_for(lambda: self._urgent,
                                         timeout=max(0.0, last + self.MIN_INTERVAL_S
                                                     - time.monotonic()))
                data = state_configmap_data(self._progress, self._suspects)
                self._dirty = self._urgent = False
                self._writing = True
            try:
                self.core.patch_namespaced_config_map(self.name, self.namespace,
                                                      {"data": data})
            except client.ApiException as e:
                log.warning("could not write the job's state: %s", e.reason)
                with self._ready:
                    self._dirty = True  # retried with the next report or the next turn
            last = time.monotonic()
            with self._ready:
                self._writing = False
                self._ready.notify_all()


class ClusterCoordinator:
    def __init__(self, chan: JobChannel, plans: PlanFollower, state: StateReporter,
                 total_steps: int | None = None, record: Progress | None = None,
                 checkpoints: Checkpoints | None = None):
        """``record``: the durable record a predecessor left, None on the job's first;
        ``checkpoints``: the job's checkpoints, to choose the one to restore."""
        self.chan = chan
        self.total_steps = total_steps
        self.plans = plans
        self.state = state
        self.record = record
        # It runs as long as the job: only the last reconfigurations are kept in memory.
        self.steps = StepCoordinator(chan, lambda line: emit("info", message=line), checkpoints,
                                     keep_reconfigurations=16)
        self.pending: Published | None = None  # the newest plan, not published yet
        self.seen = 0
        self.started = time.monotonic()
        self.resumed = False
        self.suspects: dict[str, str] = {}
        self.lost_since: dict[str, float] = {}
        self.stopping = threading.Event()
        self.finished_at: float | None = None  # when the last step was committed

    def run(self) -> None:
        # Stopping (SIGTERM) tells the workers nothing: this pod may be being replaced, and
        # a deleted job's workers are deleted with it. Only the last step stops them.
        while not self.stopping.is_set():
            self.tick()
            time.sleep(0.002)

    def tick(self) -> None:
        """Take the newest plan if it can be published now, commit a prepared step, and
        say which workers are lost; once the job is done, wait for its ranks to leave."""
        if self.finished_at is not None:
            self._await_exits()
            return
        self._follow_plans()
        prepared = self.steps.poll()
        if prepared is not None:
            self._complete(prepared)
        self._watch_workers()

    def _follow_plans(self) -> None:
        newest = self.plans.newest()
        if newest is not None and newest.plan.generation > self.seen:
            self.seen = newest.plan.generation
            self.pending = newest  # replaces one still waiting for its step boundary
        if self.pending is not None and self._ready(self.pending) and not self._at_boundary(
                self.pending):
            self._publish(self.pending, boundary=None)

    def _complete(self, prepared: PreparedStep) -> None:
        # Logged before it is committed: if this process dies in between, the step is either
        # applied by the workers all the same (a replacement rolls it forward) or redone and
        # logged again; never applied without a trace.
        emit("step", step=prepared.step, generation=prepared.generation, loss=prepared.loss,
             samples=prepared.sample_ids)
        last = self.total_steps is not None and prepared.step >= self.total_steps
        if last:
            self.steps.commit(prepared, last=True)  # the workers apply it and stop
            # Logged before the report below, which the writer thread may send at once:
            # whoever sees the job Succeeded must find the line already there.
            emit("finished", step=prepared.step)
        elif self.pending is not None and self._ready(self.pending):
            self._publish(self.pending, boundary=prepared)
        else:
            self.steps.commit(prepared)
        self.state.report(self.steps.progress(prepared))
        if last:
            self.state.flush()  # the operator learns from it that the job is done
            self.finished_at = time.monotonic()

    def _await_exits(self) -> None:
        """Stop once every rank of the last plan has exited or is lost. Stopping at the last
        commit took the store from ranks that had not read it yet: they reconnected for
        minutes, and their pods failed though the job had finished."""
        members = sorted(self.steps.directive.plan.members())
        gone = self.steps.lost_workers(members)
        left = [m for m in members if m not in gone]
        if not left:
            emit("stopped", workers=len(members))
        elif time.monotonic() - self.finished_at > FINISH_WAIT_S:
            emit("stopped", workers=len(members), still_running=left)
        else:
            return
        self.stopping.set()

    def _ready(self, p: Published) -> bool:
        """Every worker of the plan is up: a plan naming a worker still importing torch
        would hold every survivor at the rendezvous until it arrives."""
        return all(self.chan.said_hello(m) for m in p.plan.members())

    def _at_boundary(self, p: Published) -> bool:
        """Whether ``p`` can wait for the next step boundary: the current generation is in
        place, every one of its members still runs, and steps are being made (a plan for
        a stalled job has no boundary to wait for)."""
        d = self.steps.directive
        adopted = self.steps.adopted
        return (d is not None and adopted is not None and adopted.generation == d.generation
                and set(d.plan.members()) <= p.alive(d.plan) and p.plan.reason != STALLED)

    def _publish(self, p: Published, boundary: PreparedStep | None) -> None:
        if not self.resumed:
            # The first plan this coordinator publishes starts from what the workers hold
            # (nothing, on the job's first start; everything, after a replacement).
            r = self.record
            self.steps.resume({m: h for m in p.plan.members()
                               if (h := self.chan.hello_of(m)) is not None},
                              r.step if r else 0, r.checkpoint_step if r else None,
                              r.restores if r else 0)
            self.resumed = True
        before = self.steps.directive.plan if self.steps.directive is not None else None
        d = self.steps.publish(p.plan, p.alive(before), boundary=boundary)
        self.pending = None
        emit("plan", generation=p.plan.generation, reason=p.plan.reason,
             workers=p.plan.world_size, boundary=boundary is not None,
             start_step=d.start_step, restored_step=d.restore_step,
             experts_migrated=self.steps.reconfigs[-1].experts_migrated,
             roll_forward=d.roll_forward, draining=sorted(d.draining))

    def _watch_workers(self) -> None:
        """The workers the heartbeats and failure reports say are lost, and, for a
        replacement coordinator, the plan's workers that never reconnected: the operator
        re-plans without them."""
        newest = self.plans.newest()
        members = set(newest.plan.members()) if newest is not None else set()
        if self.steps.directive is not None:
            members |= set(self.steps.directive.plan.members())
        # A lost worker is out of the plan by now, but stays watched: if it beats again it
        # is back. One that stays silent long after Kubernetes must have noticed is dropped;
        # one that exited never comes back, and stays lost while its pod lives (its node's
        # other ranks may go on for hours).
        now = time.monotonic()
        self.lost_since = {n: self.lost_since.get(n, now) for n in self.suspects}
        members |= {n for n, since in self.lost_since.items()
                    if now - since < FORGET_LOST_S or n in self.steps.exited}
        suspects = self.steps.lost_workers(sorted(members))
        # A predecessor's finding stands until the worker is heard from again.
        suspects |= {n: why for n, why in self.state.inherited.items()
                     if not self.steps.liveness.heard(n)}
        if (self.record is not None and not self.resumed
                and time.monotonic() - self.started > RECONNECT_WAIT_S):
            suspects |= {n: f"did not reconnect within {RECONNECT_WAIT_S:.0f} s of a new "
                            f"coordinator" for n in sorted(members)
                         if not self.chan.said_hello(n)}
        if suspects != self.suspects:
            for n in sorted(suspects.keys() - self.suspects.keys()):
                emit("lost", worker=n, reason=suspects[n])
            for n in sorted(self.suspects.keys() - suspects.keys()):
                emit("back", worker=n)
            self.suspects = suspects
            self.state.suspect(suspects)


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, "time": round(time.time(), 4), **fields}), flush=True)


def _serve_store(port: int, patience_s: float = 30.0) -> dist.TCPStore:
    """The workers' store on ``port``. A predecessor on the same host (host networking, the
    local test kubelet) may still hold the port for a moment while it shuts down."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            # Its reads never wait for a key, but one (JobChannel.reports) can: this bounds it.
            return dist.TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=30))
        except (RuntimeError, OSError) as e:
            if time.monotonic() > deadline:
                raise
            log.warning("port %d is not free yet (%s); trying again", port, e)
            time.sleep(0.2)


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
    state = StateReporter(core, env.namespace, env.state_configmap)
    record = state.read()
    store = _serve_store(env.port)
    coordinator = ClusterCoordinator(JobChannel(store, env.key, env.job),
                                     PlanFollower(core, env.namespace, env.plan_configmap).start(),
                                     state.start(), env.steps, record,
                                     Checkpoints.open(env.checkpoint_path, env.job_uid)
                                     if env.checkpoint_path else None)
    terminated = threading.Event()

    def on_sigterm(*_):
        terminated.set()
        coordinator.stopping.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    emit("serving", port=env.port, job=env.job,
         resuming_from=record.step if record is not None else None)
    coordinator.run()
    # Exit 0 says the job is done (the operator then replaces nothing); stopped from outside,
    # the pod is being deleted or moved, and a successor takes over.
    return 128 + signal.SIGTERM if terminated.is_set() else 0

if __name__ == "__main__":
    sys.exit(main())
