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
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from lazarus_core.cluster_contract import JOB_KEY_ENV
from lazarus_core.runtime_config import RuntimeConfig

from . import checkpoint
from .collectives import Collectives, CollectiveInterrupted, CollectiveTimeout
from .data import StepBatches
from .engine import Engine
from .job_channel import ChannelTimeout, Directive, JobChannel, StepReport
from .process_group import join_generation, leave_generation
from .state_exchange import exchange

log = logging.getLogger("lazarus.worker")

class GenerationEnded(Exception):
    """The current generation is over (failure, interruption, or a newer plan)."""


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
                log.warning("%s: %s", self.node, e)
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
                log.warning("%s: %s", self.node, e)
                self._leave(failed=True)
            if self.chan.stopped():
                self._leave(failed=False)
                return 0

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
                raise GenerationEnded(f"expert transfers of generation {g}: {e}") from e
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
            raise GenerationEnded(f"joining generation {g}: {e}") from e
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
                raise GenerationEnded(f"step {step}: {e}") from e
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
    """Environment, as the operator's worker pods (and the local backend) set it:
    LAZARUS_COORDINATOR (host:port of the coordinator's store), LAZARUS_NODE_NAME (the node
    this worker runs on: plans name nodes), LAZARUS_RUNTIME (``spec.runtime`` as JSON),
    LAZARUS_JOB and LAZARUS_JOB_KEY (the job's name and key: every message on the channel
    is signed), optionally LAZARUS_CHECKPOINT_PATH and LAZARUS_CHECKPOINT_EVERY_STEPS."""
    logging.basicConfig(level=os.environ.get("LAZARUS_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(int(os.environ.get("LAZARUS_THREADS", "1")))
    missing = [v for v in ("LAZARUS_COORDINATOR", "LAZARUS_NODE_NAME", "LAZARUS_RUNTIME",
                           "LAZARUS_JOB", JOB_KEY_ENV)
               if not os.environ.get(v)]
    if missing:
        print(f"lazarus worker: error: {', '.join(missing)} not set; a worker is started by "
              f"its coordinator (`lazarus run JOB.yaml --local` starts both) or by the "
              f"operator", file=sys.stderr)
        return 2
    host, port = os.environ["LAZARUS_COORDINATOR"].rsplit(":", 1)
    cfg = RuntimeConfig.from_manifest(json.loads(os.environ["LAZARUS_RUNTIME"]))
    checkpoint_dir = os.environ.get("LAZARUS_CHECKPOINT_PATH")
    settings = WorkerSettings(
        checkpoint_dir=Path(checkpoint_dir) if checkpoint_dir else None,
        checkpoint_every=int(os.environ.get("LAZARUS_CHECKPOINT_EVERY_STEPS") or 0),
        collective_timeout_s=float(os.environ.get("LAZARUS_COLLECTIVE_TIMEOUT_S", "60")),
    )
    store = dist.TCPStore(host, int(port), is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    chan = JobChannel(store, os.environ[JOB_KEY_ENV], os.environ["LAZARUS_JOB"])
    return Worker(chan, os.environ["LAZARUS_NODE_NAME"], cfg, settings).run()


if __name__ == "__main__":
    sys.exit(main())
