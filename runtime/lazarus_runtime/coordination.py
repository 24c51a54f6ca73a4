"""The coordinator's side of the job channel, whatever runs the workers.

A ``StepCoordinator`` turns plans into directives and drives the workers through them: it
decides the handover from what the workers really hold (``lazarus_core.handover``: the
transfers, or a checkpoint restore when some expert lost every replica), confirms adoption
once every member fetched its state, commits each step that every rank prepared, and
judges from the workers' heartbeats and failure reports which of them are lost
(``lazarus_core.liveness``). A replacement coordinator starts from what the workers say
they hold (``resume``), so nothing of its predecessor's memory is needed. The
local backend feeds it plans from the controller core it runs itself; on Kubernetes the
coordinator pod feeds it the plans the operator publishes. Both record the same timings.

Its workers are rank processes, one per GPU, named by node and GPU (``plan.member_name``):
it plans each handover on the plans' per-rank views (``Plan.by_rank``), so a replica moves
to the very GPU that needs it, between two GPUs of one node too, and a lost GPU is a lost
worker like any other.

It acts only on what the workers signed (job_channel.py): a counter says when to look, the
signed reports decide. It keeps no per-step history, and prunes the channel's keys behind
it, so a job of a million steps needs the memory of a job of ten.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from lazarus_core.cluster_contract import exit_reason
from lazarus_core.controller import Progress
from lazarus_core.handover import Held, caught_up, held_under, plan_handover, resume_point
from lazarus_core.liveness import BEAT_S, Liveness
from lazarus_core.plan import Plan

from .checkpoint import Checkpoints
from .job_channel import Directive, Hello, JobChannel, RankExit, StepReport


@dataclass
class Reconfiguration:
    generation: int
    reason: str
    members: int             # ranks that report timings for this generation
    experts_migrated: int
    restored_step: int | None
    experts_lost: int
    fault_at: float          # when the fault happened (kill) or the change was decided
    detected_at: float
    published_at: float
    adopted_at: float | None = None
    resumed_at: float | None = None  # first step committed under this generation
    worker_timings: dict[str, dict[str, float]] = field(default_factory=dict)

    def summary(self) -> dict:
        end = self.resumed_at or self.adopted_at or self.published_at
        rebuild = max((t.get("rebuild_s", 0.0) for t in self.worker_timings.values()),
                      default=0.0)
        migrate = max((t.get("migrate_s", 0.0) for t in self.worker_timings.values()),
                      default=0.0)
        adopted = self.adopted_at or self.published_at
        return {
            "generation": self.generation,
            "reason": self.reason,
            "seconds": round(end - self.fault_at, 4),
            "experts_migrated": self.experts_migrated,
            "restored_step": self.restored_step,
            "breakdown": {
                "detection_s": round(self.detected_at - self.fault_at, 4),
                "replanning_s": round(self.published_at - self.detected_at, 4),
                "communication_rebuild_s": round(rebuild, 4),
                "migration_s": round(migrate, 4),
                "redone_step_s": round(max(0.0, end - adopted), 4),
            },
        }


@dataclass(frozen=True)
class PreparedStep:
    """A step every rank of the current generation prepared, not committed yet."""
    step: int
    generation: int
    reports: list[StepReport]

    @property
    def loss(self) -> float:
        return self.reports[0].loss

    @property
    def sample_ids(self) -> list[int]:
        return [i for r in self.reports for i in r.sample_ids]


# A step's keys are deleted once this many later steps are committed: every rank has read
# its commit by then (a rank prepares step s + 1 only after reading the commit of s).
KEEP_STEPS = 4
# A generation's keys are deleted once this many newer generations were published.
KEEP_GENERATIONS = 2


class StepCoordinator:
    def __init__(self, chan: JobChannel, on_event: Callable[[str], None] = lambda line: None,
                 checkpoints: Checkpoints | None = None, liveness: Liveness | None = None,
                 keep_reconfigurations: int | None = None):
        self.chan = chan
        self.on_event = on_event
        # The job's checkpoints, read to choose the one to restore (None: not configured).
        self.checkpoints = checkpoints
        self.adopted: Plan | None = None
        # What the live workers hold, per rank process, as of the step each applied last: the
        # adopted plan's layout (with the incarnation of each member when it adopted it: a
        # worker that came back on the same node holds nothing), or, after a resume, what
        # each worker reported until the next adoption.
        self.held: dict[str, Held] = {}
        self.incarnations: dict[str, str] = {}
        self.roll_forward: int | None = None
        self.directive: Directive | None = None
        self.committed = 0
        self.liveness = liveness or Liveness()
        self._looked_at = 0.0
        self._lost: dict[str, str] = {}
        # Of the members looked at last, those whose agent saw them exit: lost for good,
        # unlike a silent one, which may beat again.
        self.exited: dict[str, RankExit] = {}
        self._failures_seen = 0
        self._step_started = time.monotonic()
        # The furthest step ever prepared: a step at or below it is being redone.
        self.highest_step = 0
        # In publication order; a long-running coordinator keeps the last few (None: all).
        self.reconfigs: deque[Reconfiguration] = deque(maxlen=keep_reconfigurations)
        self.restores = 0
        self.redone = 0
        # Keys in the store, oldest first, to prune: (generation, step, world size) of
        # steps prepared, and the directives published.
        self._steps: deque[tuple[int, int, int]] = deque()
        self._generations: deque[Directive] = deque()

    @property
    def generation(self) -> int:
        return self.directive.generation if self.directive else 0

    # --- steps ---------------------------------------------------------------------------

    def poll(self) -> PreparedStep | None:
        """Confirm the adoption of the current generation once every member fetched its
        state; then return the next step once every rank prepared it."""
        self.chan.guard()
        d = self.directive
        if d is None:
            return None
        g = d.generation
        if self.adopted is None or self.adopted.generation != g:
            if self.chan.all_fetched(g, d.exchange_ranks()):
                self.chan.adopt(g)
                self._adopted(d)
                self._reconfig(g, lambda r: setattr(r, "adopted_at", time.monotonic()))
            return None
        step = self.committed + 1
        reports = self.chan.reports(g, step, d.plan.world_size)
        if reports is None:
            return None
        if step <= self.highest_step:
            self.redone += 1
        self.highest_step = max(self.highest_step, step)
        self._reconfig(g, self._resumed)
        return PreparedStep(step, g, reports)

    def commit(self, step: PreparedStep, last: bool = False) -> None:
        """Let the workers apply ``step`` and go on in the same generation (or stop)."""
        if last:
            self.chan.stop()
        self.chan.commit(step.generation, step.step, step.generation)
        self._committed(step.step)
        self._written(step)

    def _committed(self, step: int) -> None:
        now = time.monotonic()
        if step == self.committed + 1:
            self.liveness.step_took(now - self._step_started)
        self._step_started = now
        self.committed = step
        self.held = {n: Held(h.experts, step) for n, h in self.held.items()}

    def _adopted(self, d: Directive) -> None:
        """Every member of ``d`` fetched its state: they now hold its plan's layout."""
        self.adopted = d.plan
        members = set(d.plan.members())
        self.held = held_under(d.plan.by_rank(), members, self.committed)
        self.incarnations = {n: h.incarnation for n in members
                             if (h := self.chan.hello_of(n)) is not None}
        self.roll_forward = None

    # --- a replacement coordinator -------------------------------------------------------

    def resume(self, hellos: dict[str, Hello], committed_at_least: int,
               checkpoint_step: int | None, restores: int) -> None:
        """Start from what reconnecting workers hold, as a coordinator that replaced one
        that died. ``committed_at_least`` and ``checkpoint_step`` come from the job's
        durable record (which may lag a little: the workers' reports settle the step)."""
        stateful = {n: h for n, h in hellos.items() if h.holdings is not None}
        committed, roll = resume_point({n: (h.committed, h.prepared)
                                        for n, h in stateful.items()})
        self.committed = max(committed, committed_at_least)
        self.roll_forward = roll if self.committed == committed else None
        self.held = {n: Held(tuple(frozenset(layer) for layer in h.holdings),
                             caught_up(h.committed, h.prepared, self.roll_forward))
                     for n, h in stateful.items()}
        self.incarnations = {n: h.incarnation for n, h in hellos.items()}
        self.restores = restores
        if checkpoint_step is not None:
            self.chan.set_checkpoint(checkpoint_step)
        self.on_event(f"resuming at step {self.committed} from what {len(stateful)} workers "
                      f"hold" + (f"; those one step behind apply step {roll} first"
                                 if self.roll_forward else ""))

    # --- liveness ------------------------------------------------------------------------

    def lost_workers(self, members: list[str]) -> dict[str, str]:
        """Of ``members``, those that are lost, each with the reason: their agent saw them
        exit, or their heartbeats and their peers' failure reports say so (read from the
        store at most every BEAT_S)."""
        now = time.monotonic()
        if now - self._looked_at < BEAT_S:
            return {m: why for m, why in self._lost.items() if m in members}
        self._looked_at = now
        g = self.generation
        failures = self.chan.failures(g, members) if g else 0
        if failures > self._failures_seen:
            self.liveness.peer_failed(now)
        self._failures_seen = failures
        for member, beat in self.chan.beats(members).items():
            self.liveness.beat(member, beat, now)
        self._lost = self.liveness.lost(members, now)
        self.exited = self.chan.exits(members)
        for member, how in self.exited.items():
            self._lost[member] = exit_reason(how.status, how.last_words, how.pod)
        return self._lost


    # --- plans ---------------------------------------------------------------------------

    def publish(self, plan: Plan, alive: set[str], *, boundary: PreparedStep | None = None,
                fault_at: float | None = None, detected_at: float | None = None) -> Directive:
        """Publish ``plan`` to the workers. ``alive``: the workers (rank processes) that
        still run (one out of the plan but alive sends its experts away, as after a spot
        notice on its node).

        With ``boundary`` the change happens between steps: that step is committed and the
        workers switch to ``plan`` right after it. Otherwise the switch is immediate and
        any step in flight is dropped and redone (its optimizer step was never applied)."""
        if boundary is not None:
            self._committed(boundary.step)
            self._written(boundary)
        elif self.directive is not None:  # the step in flight is dropped: its keys go too
            self._steps.append((self.generation, self.committed + 1,
                                self.directive.plan.world_size))
        held = self._held_by(alive)
        ranks = plan.by_rank()
        handover = plan_handover(held, ranks, self.committed, self.chan.checkpoint(),
                                 self.roll_forward)
        if handover.restore_step is not None and self.checkpoints is not None:
            handover = plan_handover(held, ranks, self.committed, self._restorable(),
                                     self.roll_forward)
        directive = Directive.of(plan, handover)
        if handover.restore_step is not None:
            restored = handover.restore_step
            self.restores += 1
            self.on_event(f"{len(handover.lost)} (layer, expert) pairs lost every replica: "
                          + (f"restoring the checkpoint of step {restored}" if restored
                             else "no checkpoint yet, restarting from step 0"))
            self.committed = restored
        self._failures_seen = 0  # the new generation's counter starts at zero
        now = time.monotonic()
        self.reconfigs.append(Reconfiguration(
            plan.generation, plan.reason, len(directive.exchange_ranks()),
            handover.experts_migrated, handover.restore_step, len(handover.lost),
            fault_at=fault_at or detected_at or now, detected_at=detected_at or now,
            published_at=now))
        self.directive = directive
        if boundary is not None:  # announced by the commit, then switched to
            self.chan.publish(directive, switch=False)
            self.chan.commit(boundary.generation, boundary.step, plan.generation)
            self.chan.switch_to(plan.generation)
        else:
            self.chan.publish(directive)
        self._generations.append(directive)
        self._prune()
        ranks = (f" ({plan.world_size} ranks)" if plan.world_size != len(plan.nodes)
                 else "")
        self.on_event(f"generation {plan.generation} ({plan.reason}): {len(plan.nodes)} "
                      f"workers{ranks}, {handover.experts_migrated} expert replicas migrated"
                      + (f", restored step {handover.restore_step}"
                         if handover.restore_step is not None else ""))
        return directive

    def _restorable(self) -> int | None:
        """The newest checkpoint whose every shard reads back whole: a corrupt or partial
        newer one is skipped, so every worker loads the same good state. Storage trouble
        falls back to the step the workers last recorded."""
        try:
            ck, skipped = self.checkpoints.newest_intact()
        except Exception as e:  # noqa: BLE001 - an unreachable store must not stop the job
            self.on_event(f"could not read the checkpoints ({e}); trying the one of step "
                          f"{self.chan.checkpoint()}")
            return self.chan.checkpoint()
        for why in skipped:
            self.on_event(f"checkpoint skipped: {why}")
        return ck.step if ck is not None else None

    def progress(self, step: PreparedStep) -> Progress:
        """The controller's progress event for ``step``: with the loads and the newest
        checkpoint, what this coordinator did to bring the workers to its generation."""
        r = next(r for r in reversed(self.reconfigs) if r.generation == step.generation)
        error, failures = self.chan.checkpoint_health()
        return Progress(step=step.step, generation=step.generation,
                        loads=step.reports[0].loads, checkpoint_step=self.chan.checkpoint(),
                        experts_migrated=r.experts_migrated, restored_step=r.restored_step,
                        experts_lost=r.experts_lost, restores=self.restores,
                        checkpoint_error=error, checkpoint_failures=failures)

    def _held_by(self, alive: set[str]) -> dict[str, Held]:
        """What the ``alive`` workers hold, less any that came back as a new process since
        (same node, new incarnation: it holds nothing)."""
        out = {}
        for n, h in self.held.items():
            if n not in alive:
                continue
            now = self.chan.hello_of(n)
            if now is not None and n in self.incarnations \
                    and now.incarnation != self.incarnations[n]:
                continue
            out[n] = h
        return out

    def summaries(self) -> list[dict]:
        """The reconfigurations after the first plan, with the workers' own timings."""
        for r in self.reconfigs:
            self._collect_timings(r)
        return [r.summary() for r in self.reconfigs if r.generation > 1]

    def _resumed(self, r: Reconfiguration) -> None:
        """The first step under a generation: its members have reported their timings."""
        if r.resumed_at is None:
            r.resumed_at = time.monotonic()
            self._collect_timings(r)

    def _collect_timings(self, r: Reconfiguration) -> None:
        r.worker_timings |= {
            str(rank): t for rank in range(r.members)
            if str(rank) not in r.worker_timings
            and (t := self.chan.timings(r.generation, rank)) is not None}

    def _written(self, step: PreparedStep) -> None:
        self._steps.append((step.generation, step.step, len(step.reports)))
        self._prune()

    def _prune(self) -> None:
        """Delete the keys of steps and generations that every worker has moved past."""
        while len(self._steps) > KEEP_STEPS:
            self.chan.prune_step(*self._steps.popleft())
        while len(self._generations) > KEEP_GENERATIONS + 1:
            old = self._generations.popleft()
            self._reconfig(old.generation, self._collect_timings)
            members = old.exchange_ranks()
            self.chan.prune_generation(old.generation, members, len(members))

    def _reconfig(self, generation: int, update) -> None:
        for r in reversed(self.reconfigs):
            if r.generation == generation:
                update(r)
                return
