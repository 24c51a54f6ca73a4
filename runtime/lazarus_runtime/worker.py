"""A worker: trains under whatever plan generation its coordinator publishes, and survives
the loss of its peers.

    python -m lazarus_runtime.worker   (configured by the environment, see ``main``)

For each generation the worker joins a process group scoped to it, brings its state up to
the plan (checkpoint restore, expert transfers, or a fresh start), then runs steps. A step
that a failure interrupts is dropped before it changed anything and redone in the next
generation with the same global batch. A new generation interrupts any wait, collectives
included, so a dead or frozen peer never hangs a survivor.
"""
from __future__ import annotations

import datetime
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from lazarus_core import process_env as penv
from lazarus_core.runtime_config import RuntimeConfig

from . import checkpoint
from .collectives import (Collectives, CollectiveInterrupted, CollectiveTimeout,
                          failure_reason)
from .data import StepBatches
from .engine import Engine
from .job_channel import ChannelTimeout, Directive, JobChannel, StepReport
from .process_group import join_generation, leave_generation
from .state_exchange import exchange

log = logging.getLogger("lazarus.worker")

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
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    device: str = "cpu"


class Worker:
    def __init__(self, chan: JobChannel, node: str, cfg: RuntimeConfig,
                 settings: WorkerSettings):
        self.chan = chan
        store = chan.store
        self.store = store
        self.node = node
        self.cfg = cfg
        self.settings = settings
        self.batches = StepBatches.from_config(cfg.data, cfg.model.seq_len, cfg.model.vocab)
        self.engine: Engine | None = None
        self.comm: Collectives | None = None
        self.committed = 0  # last step applied

    # --- the loop of generations ---------------------------------------------------------

    def run(self) -> int:
        self.chan.hello(self.node)
        seen = 0
        while True:
            generation = self._next_generation(seen)
            if generation is None:
                return 0
            seen = generation
            directive = self.chan.wait_directive(generation, self.settings.plan_timeout_s)
            if directive is None:
                continue  # superseded before it could be read: take the newer one
            if self.node not in directive.exchange_ranks():
                if self.engine is not None:
                    log.info("%s: not in generation %d, leaving", self.node, generation)
                    return 0
                continue  # not placed yet: a later generation may take us
            try:
                self._adopt(directive)
            except GenerationEnded as e:
                self._log_ended(e)
                self._leave(failed=True)
                continue  # nothing changed: the coordinator plans from our last layout
            except StateLost:
                self._leave(failed=True)
                return EXIT_STATE_LOST
            if self.node not in {n.name for n in directive.plan.nodes}:
                self._leave(failed=False)
                return 0  # a draining node: its experts are sent, its work is done
            try:
                self._train(directive)
            except GenerationEnded as e:
                self._log_ended(e)
                self._leave(failed=True)
            if self.chan.stopped():
                self._leave(failed=False)
                return 0

    def _log_ended(self, e: GenerationEnded) -> None:
        # A generation ending is routine (a peer died, a newer plan came): one line in our
        # words at INFO; the backend's raw error only at DEBUG.
        log.info("%s: %s", self.node, e)
        if e.__cause__ is not None:
            log.debug("%s: %s", self.node, e.__cause__)

    def _next_generation(self, seen: int) -> int | None:
        deadline = time.monotonic() + self.settings.plan_timeout_s
        while True:
            if self.chan.stopped():
                return None
            latest = self.chan.latest()
            if latest > seen:
                return latest
            if time.monotonic() > deadline:
                raise ChannelTimeout(f"{self.node}: no plan after generation {seen} within "
                                     f"{self.settings.plan_timeout_s:.0f} s")
            self.chan.guard()
            time.sleep(0.005)

    # --- taking a plan -------------------------------------------------------------------

    def _adopt(self, d: Directive) -> None:
        g = d.generation
        ranks = d.exchange_ranks()
        in_plan = self.node in {n.name for n in d.plan.nodes}
        rank = ranks[self.node]
        timings = {"rebuild_s": 0.0, "migrate_s": 0.0}
        self._leave(failed=False)
        # The draining nodes of a spot notice only send: they join an exchange group that
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
                experts, dense = exchange(comm, self.cfg.model, self.engine, self.node, ranks,
                                          d.transfers, d.joiners, d.dense_source,
                                          stepped=d.start_step > 1)
            except (CollectiveInterrupted, CollectiveTimeout, RuntimeError) as e:
                raise GenerationEnded.by(f"expert transfers of generation {g}", e) from e
        self.chan.fetched(g, self.node)
        if not self.chan.wait_adopted(g, self.settings.plan_timeout_s):
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
            raise RuntimeError(f"{self.node}: holds step {self.committed}, generation {g} "
                               f"starts at {d.start_step}")
        self.chan.report_timings(g, rank, timings)

    def _join(self, scope: str, rank: int, world_size: int, g: int,
              timings: dict[str, float]) -> Collectives:
        start = time.perf_counter()
        try:
            self.comm = join_generation(self.store, scope, rank, world_size,
                                        timeout_s=self.settings.collective_timeout_s,
                                        interrupted=lambda: self.chan.latest() > g)
        except (RuntimeError, TimeoutError) as e:
            raise GenerationEnded.by(f"joining generation {g}", e) from e
        timings["rebuild_s"] += time.perf_counter() - start
        return self.comm

    def _leave(self, failed: bool) -> None:
        if self.comm is not None:
            leave_generation(self.comm, failed=failed)
            self.comm = None

    def _restore(self, d: Directive, rank: int, comm: Collectives) -> None:
        engine = Engine(self.cfg, d.plan, rank, comm, self.batches, self.settings.device)
        if d.restore_step:
            ck = checkpoint.latest(self.settings.checkpoint_dir, at_most=d.restore_step)
            if ck is None or ck.step != d.restore_step:
                raise RuntimeError(f"checkpoint of step {d.restore_step} not found in "
                                   f"{self.settings.checkpoint_dir}")
            engine.load_state(*ck.load(set(engine.held_experts())))
        self.engine = engine
        self.committed = d.restore_step
        log.info("%s: restored step %d for generation %d", self.node, d.restore_step,
                 d.generation)

    # --- training ------------------------------------------------------------------------

    def _train(self, d: Directive) -> None:
        g = d.generation
        rank = d.plan.nodes[d.plan.node_index(self.node)].ranks[0]
        step = d.start_step
        while True:
            try:
                result = self.engine.prepare(step)
            except (CollectiveInterrupted, CollectiveTimeout, RuntimeError) as e:
                raise GenerationEnded.by(f"generation {g} ended during step {step}", e) from e
            loads = self.engine.step_loads().tolist() if rank == 0 else None
            self.chan.prepare(g, step, rank, StepReport(result.loss, result.sample_ids, loads))
            next_generation = self.chan.wait_commit(g, step, self.settings.plan_timeout_s)
            if next_generation is None:
                raise GenerationEnded(f"step {step} was abandoned for a newer generation")
            self.engine.apply()
            self.committed = step
            self._maybe_checkpoint(d, rank, step)
            if next_generation > g or self.chan.stopped():
                return
            step += 1

    def _maybe_checkpoint(self, d: Directive, rank: int, step: int) -> None:
        every = self.settings.checkpoint_every
        if not every or step % every or self.settings.checkpoint_dir is None:
            return
        owned = {key: self.engine.expert_state(key)
                 for key in checkpoint.owned_experts(d.plan, rank)}
        dense = self.engine.dense_state() if rank == 0 else None
        info = checkpoint.write_shard(self.settings.checkpoint_dir, step, rank, owned, dense)
        self.chan.checkpoint_written(d.generation, step, rank, info)
        if rank != 0:
            return
        shards: list[list[dict]] = []

        def written() -> bool:
            got = self.chan.checkpoint_shards(d.generation, step, d.plan.world_size)
            if got is not None:
                shards.append(got)
            return got is not None

        if self.chan.wait_until(written, self.settings.collective_timeout_s,
                                f"checkpoint of step {step}",
                                interrupted=lambda: self.chan.latest() > d.generation):
            checkpoint.write_manifest(self.settings.checkpoint_dir, step, shards[0])
            self.chan.set_checkpoint(step)


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
    settings = WorkerSettings(
        checkpoint_dir=Path(env.checkpoint_path) if env.checkpoint_path else None,
        checkpoint_every=env.checkpoint_every_steps,
        collective_timeout_s=env.collective_timeout_s,
    )
    host, port = env.coordinator_address
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60))
    return Worker(JobChannel(store, env.key, env.job), env.node, cfg, settings).run()


if __name__ == "__main__":
    sys.exit(main())
