"""The coordinator's side of the job channel, whatever runs the workers.

A ``StepCoordinator`` turns plans into directives and drives the workers through them: it
decides the handover from the layout the workers really hold (``lazarus_core.handover``:
the transfers, or a checkpoint restore when some expert lost every replica), confirms
adoption once every member fetched its state, and commits each step that every rank
prepared. The
local backend feeds it plans from the controller core it runs itself; on Kubernetes the
coordinator pod feeds it the plans the operator publishes. Both record the same timings.

It acts only on what the workers signed (job_channel.py): a counter says when to look, the
signed reports decide. It keeps no per-step history, and prunes the channel's keys behind
it, so a job of a million steps needs the memory of a job of ten.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from lazarus_core.controller import Progress
from lazarus_core.handover import plan_handover
from lazarus_core.plan import Plan

from .job_channel import Directive, JobChannel, StepReport


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
                 keep_reconfigurations: int | None = None):
        self.chan = chan
        self.on_event = on_event
        self.adopted: Plan | None = None
        self.directive: Directive | None = None
        self.committed = 0
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
                self.adopted = d.plan
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
        self.committed = step.step
        self._written(step)

    # --- plans ---------------------------------------------------------------------------

    def publish(self, plan: Plan, alive: set[str], *, boundary: PreparedStep | None = None,
                fault_at: float | None = None, detected_at: float | None = None) -> Directive:
        """Publish ``plan`` to the workers. ``alive``: the nodes whose workers still run (a
        node out of the plan but alive sends its experts away, as after a spot notice).

        With ``boundary`` the change happens between steps: that step is committed and the
        workers switch to ``plan`` right after it. Otherwise the switch is immediate and
        any step in flight is dropped and redone (its optimizer step was never applied)."""
        if boundary is not None:
            self.committed = boundary.step
            self._written(boundary)
        elif self.directive is not None:  # the step in flight is dropped: its keys go too
            self._steps.append((self.generation, self.committed + 1,
                                self.directive.plan.world_size))
        handover = plan_handover(self.adopted, plan, alive, self.committed,
                                 self.chan.checkpoint())
        directive = Directive.of(plan, handover)
        if handover.restore_step is not None:
            restored = handover.restore_step
            self.restores += 1
            self.on_event(f"{len(handover.lost)} (layer, expert) pairs lost every replica: "
                          + (f"restoring the checkpoint of step {restored}" if restored
                             else "no checkpoint yet, restarting from step 0"))
            self.committed = restored
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
        self.on_event(f"generation {plan.generation} ({plan.reason}): {len(plan.nodes)} "
                      f"workers, {handover.experts_migrated} expert replicas migrated"
                      + (f", restored step {handover.restore_step}"
                         if handover.restore_step is not None else ""))
        return directive

    def progress(self, step: PreparedStep) -> Progress:
        """The controller's progress event for ``step``: with the loads and the newest
        checkpoint, what this coordinator did to bring the workers to its generation."""
        r = next(r for r in reversed(self.reconfigs) if r.generation == step.generation)
        return Progress(step=step.step, generation=step.generation,
                        loads=step.reports[0].loads, checkpoint_step=self.chan.checkpoint(),
                        experts_migrated=r.experts_migrated, restored_step=r.restored_step,
                        experts_lost=r.experts_lost, restores=self.restores)

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
