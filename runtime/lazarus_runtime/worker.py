"""A worker: one rank process, on one GPU of its node (or the CPU). It trains under
whatever plan generation its coordinator publishes, and survives the loss of its peers.

    python -m lazarus_runtime.worker   (started by its node agent, configured by the
                                        environment, see ``main``)

It is named by its node and GPU (``plan.member_name``); the plan says which rank that GPU
runs (``PlanNode.devices``).

For each generation the worker joins a process group scoped to it, brings its state up to
the plan (checkpoint restore, expert transfers, or a fresh start), then runs steps. A step
that a failure interrupts is dropped before it changed anything and redone in the next
generation with the same global batch. A new generation interrupts any wait, collectives
included, so a dead or frozen peer never hangs a survivor; a survivor whose collective
failed because a peer went away says so, and a thread beats for the worker meanwhile
(``heartbeat``), so the coordinator finds the lost peer in about a second.

If the coordinator itself dies, the worker keeps everything it holds in memory, reconnects
to the coordinator's Service with backoff until a replacement answers (up to a bound), and
says hello again with what it holds: the replacement carries on from there.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from lazarus_core import process_env as penv
from lazarus_core.plan import member_name
from lazarus_core.runtime_config import RuntimeConfig

from . import checkpoint
from .collectives import (Collectives, CollectiveInterrupted, CollectiveTimeout,
                          failure_reason)
from .data import StepBatches
from .engine import Engine
from .heartbeat import Heartbeat
from .job_channel import (ChannelTimeout, CoordinatorLost, Directive, Hello, JobChannel,
                          StepReport)
from .process_group import join_generation, leave_generation
from .state_exchange import exchange

log = logging.getLogger("lazarus.worker")

# A step of a reconfiguration (leaving a group, joining one, the expert exchange) that takes
# longer than this is logged with its time: a reconfiguration takes well under a second, and
# the waits that can take a collective timeout instead (a rendezvous cannot be interrupted)
# are otherwise invisible in the logs.
SLOW_PHASE_S = 5.0


@contextlib.contextmanager
def _timed(me: str, what: str):
    start = time.perf_counter()
    try:
        yield
    finally:  # failed too: a rendezvous that timed out is the case to see
        took = time.perf_counter() - start
        if took > SLOW_PHASE_S:
            log.warning("%s: %s took %.1f s", me, what, took)


class GenerationEnded(Exception):
    """The current generation is over (failure, interruption, or a newer plan)."""

    @classmethod
    def by(cls, what: str, e: BaseException) -> "GenerationEnded":
        """``what`` failed because of ``e``: our words, with ``e`` kept as the cause."""
        ended = cls(f"{what}: {failure_reason(e)}")
        ended.__cause__ = e
        return ended


class StateLost(Exception):
    """Interrupted after the coordinator counted our new layout as adopted, before it was
    in place: this worker no longer holds what the coordinator thinks, so it must leave."""


# Exit code of a worker that left because of StateLost; the coordinator counts it as lost.
EXIT_STATE_LOST = 75


@dataclass(frozen=True)
class WorkerSettings:
    collective_timeout_s: float = 60.0
    # How long to wait for the coordinator's next plan before giving up.
    plan_timeout_s: float = 300.0
    checkpoints: checkpoint.Checkpoints | None = None
    checkpoint_every: int = 0
    device: str = "cpu"
    # How long to keep trying to reach a replacement coordinator before giving up.
    reconnect_s: float = 120.0
    # The job's collective backend (process_group): gloo, or nccl with a GPU per rank.
    backend: str = "gloo"


class Worker:
    def __init__(self, connect: Callable[[float], dist.Store], key: str, job: str, node: str,
                 cfg: RuntimeConfig, settings: WorkerSettings, local_rank: int = 0):
        """``connect(timeout_s)``: a new client of the coordinator's store, or an error when
        none answers within ``timeout_s``; ``key`` and ``job`` sign every message on it.
        ``local_rank``: which of the node's GPUs (ranks) this process is."""
        self._connect = connect
        self._signing = (key, job)
        self.me = member_name(node, local_rank)
        self.cfg = cfg
        self.settings = settings
        self.batches = StepBatches.from_config(cfg.data, cfg.model.seq_len, cfg.model.vocab)
        self.engine: Engine | None = None
        self.comm: Collectives | None = None
        self.committed = 0  # last step applied
        # A step computed whose commit never came because the coordinator died meanwhile.
        self.prepared: int | None = None
        self.incarnation = uuid.uuid4().hex
        self.heartbeat = Heartbeat(lambda: JobChannel(connect(5.0), key, job), self.me)
        self._reconnect()  # the coordinator may still be starting

    # --- the loop of generations ---------------------------------------------------------

    def run(self) -> int:
        self.heartbeat.start()
        try:
            while True:
                try:
                    return self._serve()
                except CoordinatorLost as e:
                    log.warning("%s: %s; reconnecting", self.me, e)
                    self._leave(failed=True)
                    self._reconnect()
                    log.warning("%s: reconnected to the coordinator", self.me)
        finally:
            self.heartbeat.stop()

    def _serve(self) -> int:
        """Say hello, then follow the coordinator's generations until it stops the job."""
        self._hello()
        seen = 0
        while True:
            generation = self._next_generation(seen)
            if generation is None:
                return 0
            seen = generation
            directive = self.chan.wait_directive(generation, self.settings.plan_timeout_s)
            if directive is None:
                continue  # superseded before it could be read: take the newer one
            if self.me not in directive.exchange_ranks():
                # Left out (lost, then back; or not placed yet): tell the coordinator what
                # we hold and wait; the controller takes us back, or releases us.
                log.info("%s: not in generation %d; waiting to be taken back", self.me,
                         generation)
                self._hello()
                continue
            try:
                self._adopt(directive)
            except GenerationEnded as e:
                self._log_ended(e)
                self._leave(failed=True)
                continue  # nothing changed: the coordinator plans from our last layout
            except StateLost:
                self._leave(failed=True)
                return EXIT_STATE_LOST
            if self.me not in directive.plan.members():
                self._leave(failed=False)
                return 0  # a draining worker: its experts are sent, its work is done
            try:
                self._train(directive)
            except GenerationEnded as e:
                self._log_ended(e)
                self._leave(failed=True)
            if self.chan.stopped():
                self._leave(failed=False)
                return 0

    def _hello(self) -> None:
        holdings = None
        if self.engine is not None:
            per_layer = [[] for _ in range(self.cfg.model.layers)]
            for layer, expert in self.engine.held_experts():
                per_layer[layer].append(expert)
            holdings = tuple(tuple(sorted(es)) for es in per_layer)
        self.chan.hello(self.me, Hello(self.incarnation, self.committed, self.prepared,
                                       holdings, os.getpid()))

    def _reconnect(self) -> None:
        """Reach the coordinator (at start, or its replacement), with backoff, within
        ``reconnect_s``."""
        deadline = time.monotonic() + self.settings.reconnect_s
        delay = 0.1
        while True:
            try:
                self.store = self._connect(2.0)
                self.chan = JobChannel(self.store, *self._signing, on_poll=self.heartbeat.tick)
                return
            except (RuntimeError, OSError) as e:
                if time.monotonic() + delay > deadline:
                    raise CoordinatorLost(f"no coordinator answered within "
                                          f"{self.settings.reconnect_s:.0f} s ({e})") from e
                time.sleep(delay)
                delay = min(2 * delay, 2.0)

    def _superseded(self, generation: int) -> bool:
        """The interrupt hook of every wait: the loop is alive, and is it still current?"""
        self.heartbeat.tick()
        return self.chan.latest() > generation

    def _peer_failed(self, g: int, e: BaseException) -> None:
        """Tell the coordinator a collective failed for a reason other than a newer plan."""
        if not isinstance(e, CollectiveInterrupted):
            self.chan.peer_failed(g, self.me)

    def _log_ended(self, e: GenerationEnded) -> None:
        # A generation ending is routine (a peer died, a newer plan came): one line in our
        # words at INFO; the backend's raw error only at DEBUG.
        log.info("%s: %s", self.me, e)
        if e.__cause__ is not None:
            log.debug("%s: %s", self.me, e.__cause__)

    def _next_generation(self, seen: int) -> int | None:
        deadline = time.monotonic() + self.settings.plan_timeout_s
        while True:
            if self.chan.stopped():
                return None
            latest = self.chan.latest()
            if latest > seen:
                return latest
            if time.monotonic() > deadline:
                raise ChannelTimeout(f"{self.me}: no plan after generation {seen} within "
                                     f"{self.settings.plan_timeout_s:.0f} s")
            self.chan.guard()
            time.sleep(0.005)

    # --- taking a plan -------------------------------------------------------------------

    def _adopt(self, d: Directive) -> None:
        g = d.generation
        ranks = d.exchange_ranks()
        in_plan = self.me in d.plan.members()
        rank = ranks[self.me]
        timings = {"rebuild_s": 0.0, "migrate_s": 0.0}
        self.heartbeat.in_step(False)
        if (d.roll_forward is not None and self.engine is not None
                and self.prepared == d.roll_forward == self.committed + 1):
            # Our peers applied this step before the coordinator died: catch up.
            self.engine.apply()
            self.committed = d.roll_forward
        self.prepared = None
        if self.me in d.joiners:
            self.engine = None  # what we hold is behind: take everything from the survivors
        self._leave(failed=False)
        # The draining workers of a spot notice only send: they join an exchange group that
        # the training group (the plan alone) then replaces.
        comm = self._join(f"{g}-exchange" if d.draining else str(g), rank, len(ranks), g,
                          timings)
        start = time.perf_counter()
        if d.restore_step is not None:
            experts, dense = {}, None
        elif self.engine is None and d.start_step == 1 and not d.transfers:
            experts, dense = {}, None  # nothing trained yet: the seeded initial weights
        else:
            try:
                with _timed(self.me, f"the expert exchange of generation {g}"):
                    experts, dense = exchange(comm, self.cfg.model, self.engine, self.me, ranks,
                                              d.transfers, d.joiners, d.dense_source,
                                              stepped=d.start_step > 1,
                                              device=self.settings.device)
            except (CollectiveInterrupted, CollectiveTimeout, RuntimeError) as e:
                self._peer_failed(g, e)
                raise GenerationEnded.by(f"expert transfers of generation {g}", e) from e
        self.chan.fetched(g, self.me)
        with _timed(self.me, f"waiting for every member of generation {g} to have its state"):
            adopted = self.chan.wait_adopted(g, self.settings.plan_timeout_s)
        if not adopted:
            raise GenerationEnded(f"generation {g} was superseded before every member "
                                  f"had its state")
        timings["migrate_s"] = time.perf_counter() - start
        if not in_plan:
            return
        if d.draining:
            self._leave(failed=False)
            try:
                comm = self._join(str(g), rank, d.plan.world_size, g, timings)
            except GenerationEnded as e:
                raise StateLost(str(e)) from e
        start = time.perf_counter()
        if d.restore_step is not None:
            self._restore(d, rank, comm)
        elif self.engine is None:
            self.engine = Engine(self.cfg, d.plan, rank, comm, self.batches,
                                 self.settings.device)
            if dense is not None:  # a joiner: every tensor comes from the survivors
                self.engine.load_state(dense, experts)
            self.committed = d.start_step - 1
        else:
            self.engine.reconfigure(d.plan, rank, comm, experts)
        timings["migrate_s"] += time.perf_counter() - start
        if self.committed != d.start_step - 1:
            raise RuntimeError(f"{self.me}: holds step {self.committed}, generation {g} "
                               f"starts at {d.start_step}")
        self.chan.report_timings(g, rank, timings)

    def _join(self, scope: str, rank: int, world_size: int, g: int,
              timings: dict[str, float]) -> Collectives:
        start = time.perf_counter()
        try:
            with _timed(self.me, f"joining the process group of generation {scope}"):
                self.comm = join_generation(self.store, scope, rank, world_size,
                                            timeout_s=self.settings.collective_timeout_s,
                                            interrupted=lambda: self._superseded(g),
                                            backend=self.settings.backend,
                                            device=self.settings.device)
        except (RuntimeError, TimeoutError) as e:
            raise GenerationEnded.by(f"joining generation {g}", e) from e
        timings["rebuild_s"] += time.perf_counter() - start
        return self.comm

    def _leave(self, failed: bool) -> None:
        if self.comm is not None:
            with _timed(self.me, "leaving the process group" + (" (aborted)" if failed else "")):
                leave_generation(self.comm, failed=failed)
            self.comm = None

    def _restore(self, d: Directive, rank: int, comm: Collectives) -> None:
        engine = Engine(self.cfg, d.plan, rank, comm, self.batches, self.settings.device)
        if d.restore_step:
            # The coordinator chose a step whose every shard it read back whole.
            store = self.settings.checkpoints
            if store is None:
                raise RuntimeError(f"told to restore step {d.restore_step}, but this worker "
                                   f"has no checkpoint path")
            engine.load_state(*store.at(d.restore_step).load(set(engine.held_experts()),
                                                             self.settings.device))
        self.engine = engine
        self.committed = d.restore_step
        log.info("%s: restored step %d for generation %d", self.me, d.restore_step,
                 d.generation)

    # --- training ------------------------------------------------------------------------

    def _train(self, d: Directive) -> None:
        g = d.generation
        rank = d.plan.members()[self.me]
        step = d.start_step
        while True:
            self.heartbeat.in_step(True)
            try:
                with _timed(self.me, f"step {step}, the first of generation {g}") \
                        if step == d.start_step else contextlib.nullcontext():
                    result = self.engine.prepare(step)
            except (CollectiveInterrupted, CollectiveTimeout, RuntimeError) as e:
                self._peer_failed(g, e)
                raise GenerationEnded.by(f"generation {g} ended during step {step}", e) from e
            self.prepared = step
            loads = self.engine.step_loads().tolist() if rank == 0 else None
            self.chan.prepare(g, step, rank, StepReport(result.loss, result.sample_ids, loads))
            next_generation = self.chan.wait_commit(g, step, self.settings.plan_timeout_s)
            if next_generation is None:
                self.prepared = None
                raise GenerationEnded(f"step {step} was abandoned for a newer generation")
            self.engine.apply()
            self.committed, self.prepared = step, None
            self.heartbeat.in_step(False)
            self._maybe_checkpoint(d, rank, step)
            if next_generation > g or self.chan.stopped():
                return
            step += 1

    def _maybe_checkpoint(self, d: Directive, rank: int, step: int) -> None:
        every = self.settings.checkpoint_every
        store = self.settings.checkpoints
        if not every or step % every or store is None:
            return
        owned = {key: self.engine.expert_state(key)
                 for key in checkpoint.owned_experts(d.plan, rank)}
        dense = self.engine.dense_state() if rank == 0 else None
        superseded = lambda: self._superseded(d.generation)  # noqa: E731
        # A storage fault skips this checkpoint, never the training: the shard's entry says
        # why instead, and rank 0 writes no manifest for the step.
        try:
            info = store.write_shard(step, rank, owned, dense, interrupted=superseded)
        except checkpoint.CheckpointWriteFailed as e:
            log.warning("%s: checkpoint of step %d skipped: %s", self.me, step, e)
            info = {"error": str(e)}
        self.chan.checkpoint_written(d.generation, step, rank, info)
        if rank != 0:
            return
        world = d.plan.world_size
        shards: list[dict] = []

        def written() -> bool:
            got = self.chan.checkpoint_shards(d.generation, step, world)
            shards.extend(got or [])
            return got is not None

        if not self.chan.wait_until(written, self.settings.collective_timeout_s,
                                    f"checkpoint of step {step}", interrupted=superseded):
            return
        failed = [s["error"] for s in shards if "error" in s]
        if not failed:
            try:
                store.write_manifest(step, shards, interrupted=superseded)
            except checkpoint.CheckpointWriteFailed as e:
                failed = [str(e)]
        if failed:
            log.warning("%s: no checkpoint of step %d: %s", self.me, step, failed[0])
            self.chan.report_checkpoint(step, f"checkpoint of step {step} skipped: {failed[0]}")
            return
        self.chan.set_checkpoint(step)
        self.chan.report_checkpoint(step, None)


def main() -> int:
    """Configured by the environment the operator's worker pods (and the local backend)
    set: ``lazarus_core.process_env``."""
    try:
        env = penv.read_worker_env(os.environ)
        cfg = RuntimeConfig.from_manifest(env.runtime)
    except ValueError as e:
        print(f"lazarus worker: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=env.log_level, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(env.threads)
    # As a container's first process it would otherwise ignore SIGTERM, and a deleted pod
    # would wait out its whole grace period: leave at once (nothing here needs saving).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    device = "cpu"
    if env.device == "cuda":
        # The node agent shows each rank only its own GPU (CUDA_VISIBLE_DEVICES).
        device = "cuda:0"
        torch.cuda.set_device(0)
    settings = WorkerSettings(
        checkpoints=checkpoint.Checkpoints.open(env.checkpoint_path, env.job_uid,
                                                env.checkpoint_keep)
        if env.checkpoint_path else None,
        checkpoint_every=env.checkpoint_every_steps,
        collective_timeout_s=env.collective_timeout_s,
        reconnect_s=env.reconnect_s,
        device=device, backend=env.backend,
    )
    host, port = env.coordinator_address

    def connect(timeout_s: float) -> dist.Store:
        # A plain connection first: while no coordinator listens it fails at once, quietly
        # (c10d logs a stack trace for every refused attempt). The store's own timeout then
        # bounds each later call too: a coordinator that stops answering is noticed in it.
        socket.create_connection((host, port), timeout=timeout_s).close()
        return dist.TCPStore(host, port, is_master=False,
                             timeout=datetime.timedelta(seconds=timeout_s))

    try:
        worker = Worker(connect, env.key, env.job, env.node, cfg, settings, env.local_rank)
    except CoordinatorLost as e:
        print(f"lazarus worker: error: no coordinator at {env.coordinator}: {e}", file=sys.stderr)
        return 1
    return worker.run()

if __name__ == "__main__":
    sys.exit(main())
