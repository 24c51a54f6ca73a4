"""The embedded local backend: a LazarusJob as worker processes on one machine.

The parent process is the coordinator. It owns the rendezvous store (so no worker death
can take it down), starts one node agent per simulated node (``node_agent``, as a worker
pod does; each runs the node's ``gpusPerNode`` rank processes), watches them, and drives the
same controller core as the Kubernetes operator: a dead agent is a lost node, a lost rank
(its agent says it exited, or its heartbeats stopped) a lost GPU, a new agent a joining
node. Ranks are placed on this machine's GPUs in turn across nodes (``devices.share_machine``:
with more ranks than GPUs they share them, over gloo), or on the CPU where there is none.
Its StepCoordinator publishes each plan generation with the handover it decides from what
the workers really hold, and commits steps. Failures to inject (``local_faults``: a node or
one rank) and growth (``joins``) happen at chosen steps; ``restart_baseline`` turns the job
into the checkpoint-restart baseline the benchmarks compare with.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import subprocess
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from lazarus_core import controller as core
from lazarus_core import process_env as penv
from lazarus_core.job_spec import JobSpec
from lazarus_core.plan import member_device, member_name, member_node
from lazarus_core.runtime_config import RuntimeConfig
from lazarus_core.topology import NodeSpec

from .checkpoint import Checkpoints
from .coordination import PreparedStep, StepCoordinator
from .data import StepBatches
from .devices import share_machine, visible_gpus
from .job_channel import JobChannel
from .local_faults import Fault, FaultSchedule, Strike

# Deaths within this window after the first are handled as one failure (one SIGKILL of
# two workers reaches the parent as two exits a few milliseconds apart).
_SETTLE_S = 0.03
_POLL_S = 0.002

__all__ = ["Fault", "LocalJob", "RunResult"]


@dataclass
class RunResult:
    steps_completed: int
    failures: int
    reconfigurations: list[dict]
    checkpoint_restores: int
    samples_lost: int
    samples_duplicated: int
    steps_redone: int
    losses: list[float]
    workers: int
    generation: int
    wall_seconds: float
    training_seconds: float  # wall_seconds less the workers' start-up
    tokens_per_second: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class StepLedger:
    """Each committed step's loss and how many of its samples were lost or seen twice: what a
    local run reports. 24 bytes a step; a restore that redoes steps truncates it to the
    restored step, so every step counts as its last commit."""

    def __init__(self, batches: StepBatches):
        self.batches = batches
        self.losses = array("d")
        self.lost = array("q")
        self.duplicated = array("q")

    def record(self, step: int, sample_ids: list[int], loss: float) -> None:
        for column in (self.losses, self.lost, self.duplicated):
            del column[step - 1:]
        assert len(self.losses) == step - 1, "steps are committed in order"
        expected = set(self.batches.global_sample_ids(step).tolist())
        ids = set(sample_ids)
        self.losses.append(loss)
        self.lost.append(len(expected - ids))
        self.duplicated.append(len(sample_ids) - len(ids) + len(ids - expected))


class LocalJob:
    """One run of a job on local processes: build it, then ``run()`` it once."""

    def __init__(self, name: str, spec: JobSpec, workers: int, steps: int,
                 kills: Sequence[Fault] = (), joins: Sequence[tuple[int, int]] = (),
                 checkpoint_dir: Path | str | None = None, seed: int = 0,
                 on_event: Callable[[str], None] = lambda line: None,
                 on_progress: Callable[[dict], None] = lambda status: None,
                 worker_env: dict[str, str] | None = None, timeout_s: float = 600.0,
                 kill_every_s: float | None = None, duration_s: float | None = None,
                 gpus: Sequence[str] | None = None):
        """``workers``: nodes, each an agent with ``spec.gpus_per_node`` rank processes.
        ``gpus``: the GPUs the ranks may use (None: those this machine shows; () keeps
        every rank on the CPU, as the fp32 equivalence tests want)."""
        self.name = name
        self.spec = dataclasses.replace(spec, replicas=workers)
        self.workers = workers
        self.steps = steps
        self.faults = FaultSchedule(kills, seed, kill_every_s)
        self.joins = sorted(joins)
        self.checkpoint_dir = checkpoint_dir
        self.on_event = on_event
        self.on_progress = on_progress
        self.extra_env = worker_env or {}
        self.gpus = list(visible_gpus(os.environ.get(penv.CUDA_VISIBLE_DEVICES))
                         if gpus is None else gpus)
        # Every node that can be up at once, all ranks on this machine: NCCL only if none
        # shares a GPU with another.
        _, self.backend = share_machine(workers + sum(c for _, c in self.joins),
                                        spec.gpus_per_node, self.gpus)
        self.timeout_s = timeout_s
        # End at the first step of new progress past this many seconds of training: with
        # kill_every_s, a run of fixed length whatever the failures cost.
        self.duration_s = duration_s
        cfg = RuntimeConfig.from_manifest(dict(spec.runtime))
        self.batches = StepBatches.from_config(cfg.data, cfg.model.seq_len, cfg.model.vocab)
        self.tokens_per_step = cfg.data.global_batch * cfg.model.seq_len
        # The run's state; the store and the channel exist from ``run()`` on.
        self.store: dist.TCPStore | None = None
        self.chan: JobChannel | None = None
        self.steps_done: StepCoordinator | None = None
        self.procs: dict[str, subprocess.Popen] = {}  # node -> its agent
        self.started: set[str] = set()  # rank processes (members) that said hello
        self.admitted: set[str] = set()
        self.waiting_joiners: list[tuple[int, str]] = []
        self.state = core.new_job(self.spec, core.Settings(start_grace_s=0.0))
        self.failures = 0
        self.fault_at: float | None = None
        # Frozen nodes or ranks and when to thaw them; ranks found lost (their agent saw
        # them exit, or their heartbeats stopped).
        self.thaw_at: dict[str, float] = {}
        self.suspects: dict[str, str] = {}
        # When the coordinator last looked at its workers: a death is "detected" then.
        self.detected_at = time.monotonic()
        self.training_from = time.monotonic()
        # A fresh key per run, handed to the workers only: the channel is signed with it.
        self.key = penv.new_job_key()
        self.ledger = StepLedger(self.batches)

    # --- processes -----------------------------------------------------------------------

    def _spawn(self, name: str) -> None:
        checkpoint = str(self.checkpoint_dir) if self.checkpoint_dir is not None else None
        shares, _ = share_machine(len(self.procs) + 1, self.spec.gpus_per_node, self.gpus)
        env = dict(os.environ, **self.extra_env,
                   **penv.worker_env(self.spec, self.name, f"127.0.0.1:{self.store.port}", name,
                                     key=self.key, checkpoint_path=checkpoint),
                   **{penv.CUDA_VISIBLE_DEVICES: ",".join(shares[-1]),
                      penv.BACKEND: self.backend})
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "lazarus_runtime.node_agent"], env=env,
            stdin=subprocess.DEVNULL)

    def _members(self, node: str) -> list[str]:
        return [member_name(node, d) for d in range(self.spec.gpus_per_node)]

    def _said_hello(self, member: str) -> bool:
        if member not in self.started and self.chan.said_hello(member):
            self.started.add(member)
        return member in self.started

    def _running(self) -> set[str]:
        return {n for n, p in self.procs.items() if p.poll() is None}

    def _up(self, running: set[str]) -> list[str]:
        """The rank processes of the admitted nodes among ``running`` that have started."""
        return [m for n in sorted(running) if n in self.admitted for m in self._members(n)
                if self._said_hello(m)]

    def _live(self, up: list[str], lost: set[str]) -> list[NodeSpec]:
        """Each node with a rank up and not ``lost``, with the GPUs of those ranks."""
        devices: dict[str, list[int]] = {}
        for m in up:
            if m not in lost:
                devices.setdefault(member_node(m), []).append(member_device(m))
        return [NodeSpec(n, gpus=len(ds), slots_per_gpu=self.spec.slots_per_gpu,
                         zone="local", devices=tuple(ds)) for n, ds in devices.items()]

    def _pids(self, target: str) -> list[int]:
        """The processes to strike for ``target``: a node's agent and its ranks, or one rank
        (its pid from its hello)."""
        if target in self.procs:
            ranks = [h.pid for m in self._members(target)
                     if (h := self.chan.hello_of(m)) is not None and h.pid]
            return [self.procs[target].pid] + ranks
        hello = self.chan.hello_of(target)
        if hello is None or not hello.pid:
            raise RuntimeError(f"{target} has not started: no process to strike")
        return [hello.pid]

    def _strike(self, strikes: list[Strike], when: str = "as step {} began") -> None:
        for fault, names in strikes:
            if not names:
                continue
            freeze = fault.freeze_s is not None
            for n in names:
                # A node's agent and its ranks at once, as a machine that dies: a rank left
                # to die with its agent (PR_SET_PDEATHSIG) could finish the step in flight
                # first. One rank alone: a lost GPU.
                for pid in self._pids(n):
                    _signal(pid, signal.SIGSTOP if freeze else signal.SIGKILL)
                if freeze:
                    self.thaw_at[n] = time.monotonic() + fault.freeze_s
            self.fault_at = time.monotonic()
            self.failures += len(names)
            what = f"froze {', '.join(names)} (SIGSTOP) for {fault.freeze_s:g} s" if freeze \
                else f"killed {', '.join(names)} (SIGKILL)"
            self.on_event(f"{what} " + when.format(self.steps_done.committed + 1))

    def _thaw(self) -> None:
        now = time.monotonic()
        for n, at in list(self.thaw_at.items()):
            if now >= at:
                for pid in self._pids(n):
                    _signal(pid, signal.SIGCONT)
                del self.thaw_at[n]
                self.on_event(f"thawed {n} (SIGCONT)")

    def _on_deaths(self) -> None:
        """Workers died: the controller re-plans around them (see restart_baseline)."""

    # --- the run -------------------------------------------------------------------------

    def run(self) -> RunResult:
        # Its reads never wait for a key, but one (JobChannel.reports) can: this bounds it.
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=30))
        self.chan = JobChannel(self.store, self.key, self.name)
        self.steps_done = StepCoordinator(
            self.chan, self.on_event,
            Checkpoints.open(str(self.checkpoint_dir), None) if self.checkpoint_dir else None)
        start = time.monotonic()
        try:
            for i in range(self.workers):
                self._spawn(f"worker-{i}")
            self.admitted = set(self.procs)
            # Joining workers start now but are admitted only at their step: a join then
            # models capacity arriving at that step, not the time Python takes to start.
            for step, count in self.joins:
                for _ in range(count):
                    name = f"worker-{len(self.procs)}"
                    self._spawn(name)
                    self.waiting_joiners.append((step, name))
            self._await_hellos(list(self.procs), start)
            self.training_from = time.monotonic()  # every worker is up
            self.faults.start_clock(self.training_from)
            self._apply(core.handle_all(
                self.state, core.observe(self.state, self._live(self._up(self._running()),
                                                                set()), ()),
                time.time()))
            while self.steps_done.committed < self.steps:
                if time.monotonic() - start > self.timeout_s:
                    raise TimeoutError(f"the job did not finish {self.steps} steps in "
                                       f"{self.timeout_s:.0f} s")
                if (self.duration_s is not None
                        and time.monotonic() - self.training_from >= 2 * self.duration_s):
                    # No new progress for a whole extra duration (a baseline that restarts
                    # more often than it trains): stop where it stands.
                    self.steps = self.steps_done.highest_step
                    break
                self._tick()
                if self.steps_done.directive is not None:
                    self._strike(self.faults.on_clock(time.monotonic(),
                                                      self._plan_workers_alive),
                                 when="during step {}")
                self._thaw()
                time.sleep(_POLL_S)
            wall = time.monotonic() - start
            training = time.monotonic() - self.training_from
        finally:
            self._shutdown()
        return self._result(wall, training)

    def _await_hellos(self, names: list[str], start: float) -> None:
        """Wait until every rank of the nodes ``names`` has started."""
        while not all(self._said_hello(m) for n in names for m in self._members(n)):
            dead = [n for n in names if self.procs[n].poll() is not None]
            if dead:
                raise RuntimeError(f"worker {dead[0]} exited with code "
                                   f"{self.procs[dead[0]].returncode} before it started")
            if time.monotonic() - start > 120:
                raise TimeoutError("workers did not start within 120 s")
            time.sleep(0.01)

    def _tick(self) -> None:
        now = time.time()
        events = self._membership_events()
        if events:
            self._apply(core.handle_all(self.state, events, now))
        prepared = self.steps_done.poll()
        if prepared is not None:
            self._complete(prepared)

    def _membership_events(self) -> list:
        # One look at the processes decides both whether workers died (and what the
        # restart baseline does about it) and who is live: a worker dying between two looks
        # would otherwise be re-planned around without the restart. A death after the look
        # is seen at the next tick.
        running = self._running()
        if any(n not in running for n in self.state.alive):
            time.sleep(_SETTLE_S)
            self._on_deaths()
            running = self._running()
        self.detected_at = time.monotonic()
        up = self._up(running)
        # Ranks whose node runs, but lost: exited (their agent says), or by their heartbeats
        # (frozen, hung); or taken back.
        suspects = self.steps_done.lost_workers(up)
        for m in sorted(suspects.keys() - self.suspects.keys()):
            self.on_event(f"{m} is lost: {suspects[m]}")
        for m in sorted(self.suspects.keys() - suspects.keys()):
            if member_node(m) in running:
                self.on_event(f"{m} is back")
        self.suspects = suspects
        return core.observe(self.state, self._live(up, set(suspects)), ())

    def _complete(self, prepared: PreparedStep) -> None:
        """Every rank prepared the step: let the controller see it, then commit it."""
        step, reports = prepared.step, prepared.reports
        self.ledger.record(step, prepared.sample_ids, prepared.loss)
        if (self.duration_s is not None and step == self.steps_done.highest_step
                and time.monotonic() - self.training_from >= self.duration_s):
            self.steps = step  # out of time: this step is the last
        if step == self.steps:
            self.steps_done.commit(prepared, last=True)
            return
        out = core.handle_all(self.state,
                              [self.steps_done.progress(prepared)] + self._scheduled_changes(step),
                              time.time())
        if any(isinstance(x, core.PublishPlan) for x in out.decisions):
            self._apply(out, boundary=prepared)
        else:
            self._apply(out)
            self.steps_done.commit(prepared)
        self.on_progress(self._status(reports[0].loss))
        self._strike(self.faults.as_step_begins(step + 1, self._plan_workers_alive))

    def _scheduled_changes(self, step: int) -> list:
        """Joins due before ``step + 1`` starts: admit their workers and raise the target."""
        due = [name for s, name in self.waiting_joiners if s == step + 1]
        if not due:
            return []
        count = len(due)
        self.admitted.update(due)
        self.on_event(f"{', '.join(due)} joined; the job grows at the next step boundary")
        self.spec = dataclasses.replace(self.spec, replicas=self.spec.replicas + count,
                                        max_nodes=max(self.spec.max_nodes,
                                                      self.spec.replicas + count))
        return [core.SpecChanged(self.spec)]

    def _plan_workers_alive(self) -> list[str]:
        plan = self.steps_done.directive.plan
        return [n.name for n in plan.nodes if self.procs[n.name].poll() is None]

    # --- decisions -----------------------------------------------------------------------

    def _apply(self, out: core.Outcome, boundary: PreparedStep | None = None) -> None:
        self.state = out.state
        for decision in out.decisions:
            if isinstance(decision, core.PublishPlan):
                self._publish(decision, boundary)
            elif isinstance(decision, core.ReleaseWorkers):
                for n in decision.names:
                    if self.procs[n].poll() is None:
                        self.procs[n].terminate()
            elif isinstance(decision, core.Wait):
                if self.steps_done.directive is not None and all(
                        n in self.admitted for _, n in self.waiting_joiners):
                    # Locally, capacity only comes back through --join: waiting is hopeless.
                    raise RuntimeError(f"the job cannot go on: {decision.message}; start "
                                       f"more workers, or add --join")
                self.on_event(f"waiting: {decision.message}")

    def _publish(self, decision: core.PublishPlan, boundary: PreparedStep | None) -> None:
        alive = {m for n in self._running() for m in self._members(n)} - set(self.suspects)
        directive = self.steps_done.publish(decision.plan, alive, boundary=boundary,
                                            fault_at=self.fault_at, detected_at=self.detected_at)
        self.fault_at = None
        self._strike(self.faults.after_publish(directive.start_step, self._plan_workers_alive))

    # --- reporting -----------------------------------------------------------------------

    def _status(self, loss: float) -> dict:
        plan = self.steps_done.directive.plan
        return {"step": self.steps_done.committed, "steps": self.steps, "loss": loss,
                "generation": plan.generation, "workers": plan.world_size,
                "lowest_replicas": core.lowest_replicas(self.state)}

    def _result(self, wall: float, training: float) -> RunResult:
        done, ledger = self.steps_done, self.ledger
        recorded = len(ledger.losses)
        # A step never committed lost its whole batch.
        unrecorded = max(0, self.steps - recorded) * self.batches.global_batch
        return RunResult(
            steps_completed=recorded, failures=self.failures,
            reconfigurations=done.summaries(), checkpoint_restores=done.restores,
            samples_lost=sum(ledger.lost[:self.steps]) + unrecorded,
            samples_duplicated=sum(ledger.duplicated[:self.steps]), steps_redone=done.redone,
            losses=list(ledger.losses),
            workers=done.directive.plan.world_size if done.directive else 0,
            generation=done.generation, wall_seconds=round(wall, 3),
            training_seconds=round(training, 3),
            tokens_per_second=round(recorded * self.tokens_per_step / wall, 1))

    def _shutdown(self) -> None:
        for n in self.thaw_at:  # a frozen process could not see the stop
            for pid in self._pids(n):
                _signal(pid, signal.SIGCONT)
        if self.chan is not None:
            self.chan.stop()
        deadline = time.monotonic() + 20
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _signal(pid: int, signum: int) -> None:
    """Signal a process that may have exited already (a rank of a node struck twice)."""
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
