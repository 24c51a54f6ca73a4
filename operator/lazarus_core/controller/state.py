"""The controller's state of one job: what it planned, which workers live, what they did."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from ..job_spec import JobSpec
from ..plan import Plan
from ..topology import NodeSpec


@dataclass(frozen=True)
class Settings:
    # Before the first plan, wait this long after enough nodes have joined for the rest of
    # the target to join too, so generation 1 uses them instead of growing at once.
    start_grace_s: float = 10.0
    # Recovery probability is reported for k = 1..max_failures simultaneous node failures.
    max_failures: int = 5
    # Publish the same nodes again when a plan has seen no progress for this long (0: never).
    stall_s: float = 0.0
    # Workers that fail before their first step are replaced after this long, doubled for
    # each further failure in a row, up to the maximum (no crash loop).
    start_backoff_s: float = 2.0
    start_backoff_max_s: float = 300.0


@dataclass(frozen=True)
class JobState:
    spec: JobSpec
    plan: Plan | None = None
    # Nodes with a live worker, in the plan or not.
    nodes: tuple[NodeSpec, ...] = ()
    # Nodes under a spot termination notice (still alive).
    noticed: frozenset[str] = frozenset()
    # Nodes out of the plan whose workers are kept until the workers leave their generation.
    draining: frozenset[str] = frozenset()
    # Nodes whose worker died since a plan last took them in (or since the workers last
    # reported a step). A worker that comes back on such a node starts empty: a plan that
    # still names the node is stale, and the node is no source of expert state when the
    # next plan is mapped onto the nodes.
    departed: frozenset[str] = frozenset()
    step: int = 0  # last completed step
    checkpoint_step: int | None = None
    loads: tuple[tuple[int, ...], ...] | None = None
    last_rebalance_step: int = 0
    # Generation of the latest progress report; None until the job has reported a step.
    progress_generation: int | None = None
    # What the coordinator measured for ``progress_generation`` (see events.Progress).
    experts_migrated: int = 0
    restored_step: int | None = None
    experts_lost: int = 0
    restores: int = 0
    checkpoint_error: str | None = None
    checkpoint_failures: int = 0
    # Nodes whose current worker completed a step: its failure there is a loss, not a
    # failure to start.
    proven: frozenset[str] = frozenset()
    # Workers that failed before completing a step, in a row since a worker last proved
    # itself; what the last one said; the backoffs they caused (one per round of workers
    # started together); when the next may start.
    start_failures: int = 0
    start_error: str | None = None
    start_backoffs: int = 0
    start_retry_at: float | None = None
    # A non-urgent change waiting for the next step boundary (its plan reason).
    pending: str | None = None
    # When enough nodes for a first plan had joined (start grace).
    ready_since: float | None = None
    changed_at: float | None = None
    # When the latest progress report arrived.
    progress_at: float | None = None
    # The workers trained spec.steps steps and stopped: nothing is re-planned any more.
    finished: bool = False
    settings: Settings = field(default_factory=Settings)

    @cached_property
    def alive(self) -> frozenset[str]:
        # Computed once per state (states are immutable): status and the operator's node
        # events ask for it once per node, a thousand times a pass at a thousand nodes.
        return frozenset(n.name for n in self.nodes)

    @property
    def training(self) -> bool:
        return self.progress_generation is not None

    @property
    def stale(self) -> bool:
        """The published plan names a node whose worker is gone, or a GPU whose rank is:
        the workers are stuck."""
        if self.plan is None:
            return False
        live = {n.name: set(n.devices) for n in self.nodes}
        return any(n.name not in live or n.name in self.departed
                   or not set(n.devices) <= live[n.name] for n in self.plan.nodes)

    def missing_workers(self, starting: int = 0, now: float | None = None) -> int:
        """Workers to start toward the target, given ``starting`` ones not yet up (none
        while backing off from workers that failed to start)."""
        if self.finished or (now is not None and self.start_retry_at is not None
                             and now < self.start_retry_at):
            return 0
        usable = sum(1 for n in self.nodes if n.name not in self.noticed | self.draining)
        return max(0, self.spec.target_nodes - usable - starting)


def new_job(spec: JobSpec, settings: Settings = Settings()) -> JobState:
    return JobState(spec=spec, settings=settings)
