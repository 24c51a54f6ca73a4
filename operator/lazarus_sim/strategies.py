"""The three ways a job can meet a node loss, simulated on the same trace.

- ``Lazarus``: re-plan in place with the real solver (``solver.replan``); the cost is a fixed
  rebuild plus the migration plan's busiest link. Only when some expert lost every replica
  does it restore a checkpoint. Optionally it acts on spot notices before the loss.
- ``CheckpointRestart`` (DeepSpeed-like): runs only on its full world (``world_size``
  nodes, the job's size); on a loss it rolls back, waits until that many nodes are up
  again, and restarts every process.
- ``ElasticRestart`` (DS(FT)-like): on a loss it rolls back and restarts at once on the
  survivors; it grows into new nodes at its next checkpoint.

None of them runs a model that does not fit its nodes (``Job.fits``: a slot for every
expert) or on more than ``world_size`` nodes; until they can, they wait.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from lazarus_core.plan import Plan
from lazarus_core.solver import plan_job, replan
from lazarus_core.topology import NodeSpec
from .engine import Job
from .throughput import expert_parallel_imbalance, lazarus_imbalance, step_seconds
from .workload import Costs, ModelSpec

STRATEGIES = ("lazarus", "checkpoint_restart", "elastic_restart")
# Display names, after the systems the paper compares.
TITLES = {"lazarus": "Lazarus", "checkpoint_restart": "DeepSpeed", "elastic_restart": "DS(FT)"}


def first_nodes(nodes: Sequence[NodeSpec], count: int, keep: set[str] = frozenset()
                ) -> list[NodeSpec]:
    """``count`` of ``nodes`` at most: those named in ``keep`` first, then by name."""
    return sorted(nodes, key=lambda n: (n.name not in keep, n.name))[:count]


def feasible_min_replicas(f: int, nodes: Sequence[NodeSpec], experts: int) -> int:
    """f, lowered as far as 1 while there are too few slots for f replicas of each expert.

    0 means the nodes cannot hold one replica of every expert.
    """
    return min(f, sum(n.slots for n in nodes) // experts)


class _ExpertParallel(Job):
    """Standard expert parallelism: step time set by the most popular expert."""

    def __init__(self, model: ModelSpec, costs: Costs, checkpoint_every: int, node: NodeSpec,
                 world_size: int, loads: Sequence[Sequence[float]]):
        super().__init__(model, costs, checkpoint_every, node, world_size)
        self._step_s = step_seconds(model, expert_parallel_imbalance(loads))

    def step_seconds(self) -> float:
        return self._step_s

    def restart(self, nodes: list[NodeSpec]) -> None:
        self.members = nodes
        self.counts["restarts"] += 1
        self.begin("restart", self.costs.restart_total_s(self.model), lambda: None)

    def react(self, lost, joined, noticed) -> None:
        # A loss rolls back and stops every process; it restarts once the subclass's
        # ``_world`` (the nodes it would run on now) is not empty.
        if any(n.name in lost for n in self.members):
            self.counts["failures"] += 1
            self.rollback()
            self.members = []
        if not self.members and not self.busy:
            world = self._world(list(self.alive.values()))
            if world:
                self.restart(world)


class CheckpointRestart(_ExpertParallel):
    name = "checkpoint_restart"

    def start(self, nodes: list[NodeSpec]) -> None:
        # Starting is free, as for the others; a later launch is a restart.
        self.members = self._world(nodes)

    def _world(self, nodes: list[NodeSpec]) -> list[NodeSpec]:
        """Its fixed expert-parallel layout: exactly world_size nodes that hold the model."""
        world = first_nodes(nodes, self.world_size)
        return world if len(world) == self.world_size and self.fits(world) else []


class ElasticRestart(_ExpertParallel):
    name = "elastic_restart"

    def start(self, nodes: list[NodeSpec]) -> None:
        self.members = self._world(nodes)

    def _world(self, nodes: list[NodeSpec]) -> list[NodeSpec]:
        world = first_nodes(nodes, self.world_size, {n.name for n in self.members})
        return world if self.fits(world) else []

    def after_checkpoint(self) -> None:
        # Growing is a restart too, but right after a checkpoint it loses no steps.
        world = self._world(list(self.alive.values()))
        if len(world) > len(self.members):
            self.restart(world)


class Lazarus(Job):
    name = "lazarus"

    def __init__(self, model: ModelSpec, costs: Costs, checkpoint_every: int, node: NodeSpec,
                 world_size: int, loads: Sequence[Sequence[float]], min_replicas: int = 2,
                 policy: str = "mro", rebalance_every: int = 200, use_notices: bool = False):
        super().__init__(model, costs, checkpoint_every, node, world_size)
        if rebalance_every < 1:
            raise ValueError(f"strategies.lazarus.rebalance_every: must be >= 1, "
                             f"got {rebalance_every}")
        self.loads = [list(l) for l in loads]
        self.min_replicas, self.policy = min_replicas, policy
        self.rebalance_every, self.use_notices = rebalance_every, use_notices
        # Loads are unknown until the first rebalance has measured them (paper: step 200).
        self.known_loads: list[list[float]] | None = None
        self.plan: Plan | None = None  # the committed plan: what the workers hold
        self.doomed: set[str] = set()  # nodes under a spot notice
        # Why to re-plan at the next step boundary (NodeJoined, SpotNotice), if at all.
        self.pending: str | None = None
        self.rebalanced_step = 0
        self._balanced: Plan | None = None  # the last plan a rebalance found nothing to gain on
        self._step_for: tuple[Plan | None, float] = (None, 0.0)  # (plan, its step time)

    # --- throughput -------------------------------------------------------------------

    def step_seconds(self) -> float:
        plan, seconds = self._step_for
        if plan is not self.plan:
            seconds = step_seconds(self.model, lazarus_imbalance(self.plan, self.loads))
            self._step_for = (self.plan, seconds)
        return seconds

    # --- events -----------------------------------------------------------------------

    def start(self, nodes: list[NodeSpec]) -> None:
        nodes = first_nodes(nodes, self.world_size)
        f = self._min_replicas(nodes)
        if f:
            self.plan = plan_job(nodes, self.model.experts, self.model.layers, f, self.policy,
                                 max_failures=0)
            self.members = self._plan_nodes(self.plan)

    def react(self, lost, joined, noticed) -> None:
        self.doomed -= set(lost)
        if self.use_notices and set(noticed) & self._names(self.plan):
            self.doomed |= set(noticed)
            self.pending = "SpotNotice"
        held = self._names(self.plan) | {n.name for n in self.members}
        if set(lost) & held:
            self.counts["failures"] += 1
            self.interrupt()
            self.reconfigure("NodeLost")
        elif joined:
            self.pending = self.pending or "NodeJoined"
            if not self.members and not self.busy:
                self.reconfigure("NodeJoined")

    def steps_to_own_boundary(self) -> int | None:
        if self.pending:
            return 1 if self.partial else 0
        if self.step > self.rebalanced_step and self.step % self.rebalance_every == 0:
            return 0
        return self.rebalance_every - self.step % self.rebalance_every

    def at_own_boundary(self) -> None:
        if self.pending:
            self.reconfigure(self.pending)
        else:
            self.rebalance()

    # --- reconfiguration ---------------------------------------------------------------

    def reconfigure(self, reason: str) -> None:
        """Re-plan onto every live node not under notice; migrate, or restore if we must."""
        self.pending = None
        held = self._names(self.plan)
        nodes = first_nodes([n for n in self.alive.values() if n.name not in self.doomed],
                            self.world_size, held)
        if not self._min_replicas(nodes):
            # the doomed nodes are needed until they go
            nodes = first_nodes(list(self.alive.values()), self.world_size, held)
        f = self._min_replicas(nodes)
        if not f:
            self.members = []  # too few slots to hold the model: wait for nodes
            return
        fixed = self.costs.fixed_reconfiguration_s(lost=reason == "NodeLost")
        if self.plan is None:
            self._restore(plan_job(nodes, self.model.experts, self.model.layers, f,
                                   self.policy, loads=self.known_loads, max_failures=0), fixed)
            return
        sources = self._names(self.plan) & set(self.alive)
        # Without the search for fewer copies (up to a second a re-plan; a simulation makes
        # thousands): what it migrates is the fill's, which on small clusters copies up to
        # a quarter more (docs/placement.md): the simulated transfers err long.
        step = replan(replace(self.plan, min_replicas=f), nodes, reason, sources,
                      loads=self.known_loads, max_failures=0, copy_search=False)
        if not step.migration.recoverable:
            self._restore(step.plan, fixed)
            return
        self.counts["reconfigurations"] += 1
        self.counts["experts_migrated"] += step.migration.experts_migrated
        self.members = self._plan_nodes(step.plan)
        cost = fixed + self.costs.migration_s(self.model, step.migration)
        self.begin("reconfiguration", cost, lambda: self._commit(step.plan))

    def _restore(self, plan: Plan, fixed: float) -> None:
        """Some expert has no replica left: every rank reloads the last checkpoint."""
        self.counts["restores"] += 1
        self.rollback()
        self.members = self._plan_nodes(plan)
        self.begin("restart", fixed + self.costs.load_s(self.model), lambda: self._commit(plan))

    def rebalance(self) -> None:
        """Re-allocate replicas to the measured loads when the faster steps repay the move."""
        self.rebalanced_step = self.step
        self.known_loads = self.loads
        if self.plan is self._balanced:
            return  # loads are fixed in a simulation: the answer would not change
        self._balanced = self.plan
        nodes = self._plan_nodes(self.plan)
        step = replan(self.plan, nodes, "Rebalance", self._names(self.plan), loads=self.loads,
                      max_failures=0, copy_search=False)
        if not step.migration.transfers:
            return
        cost = self.costs.fixed_reconfiguration_s(lost=False) + self.costs.migration_s(
            self.model, step.migration)
        before = self.step_seconds()
        after = step_seconds(self.model, lazarus_imbalance(step.plan, self.loads))
        if (before - after) * self.rebalance_every > cost:
            self.counts["rebalances"] += 1
            self.counts["experts_migrated"] += step.migration.experts_migrated
            self.begin("reconfiguration", cost, lambda: self._commit(step.plan))

    def _commit(self, plan: Plan) -> None:
        self.plan = plan
        self.members = self._plan_nodes(plan)

    # --- helpers ----------------------------------------------------------------------

    def _min_replicas(self, nodes: list[NodeSpec]) -> int:
        """f, lowered as far as 1 to fit; 0 when the model does not fit (then it waits)."""
        return feasible_min_replicas(self.min_replicas, nodes, self.model.experts) if self.fits(
            nodes) else 0

    def _plan_nodes(self, plan: Plan) -> list[NodeSpec]:
        return [self.alive[n.name] for n in plan.nodes if n.name in self.alive]

    @staticmethod
    def _names(plan: Plan | None) -> set[str]:
        return {n.name for n in plan.nodes} if plan else set()
