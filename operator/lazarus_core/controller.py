"""The job state machine shared by the Kubernetes operator and the local backend.

A backend turns what it sees (workers dying, spot notices, new capacity, progress reports)
into events, calls ``handle(state, event, now)`` and carries out the decisions it gets back:
publish a plan generation, restore a checkpoint, release workers, or wait. The core does no
I/O and reads no clock (``now`` is seconds since the epoch, passed in), so the same input
always gives the same output, and a backend can rebuild the state after a restart from what
it stored (the latest plan, the step) plus what it observes again.

Timing rules (design.md, "Rebalancing"):
- a lost node is acted on at once: the workers are stuck until the new plan arrives;
- a spot notice is acted on at once too, while the doomed node can still send its experts;
- growth and rebalancing take effect at a step boundary: while the job trains, they wait
  for the next progress report (which marks a completed step).
Workers released from the plan (a noticed node, or a surplus node after a scale-down) are
let go only once a progress report shows the workers have moved to the new generation,
because until then they may still be sending expert state.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Union

from .allocation import InfeasibleError
from .job_spec import JobSpec, SpecError, Violation
from .migration import Migration
from .plan import Plan
from .solver import allocate_layers, plan_job, replan
from .topology import NodeSpec

# The Ready condition's reason once the job trained spec.steps steps.
SUCCEEDED = "Succeeded"
# Plan reasons: CamelCase, as status conditions and Events want them.
INITIAL = "Initial"
NODE_LOST = "NodeLost"
SPOT_NOTICE = "SpotNotice"
NODE_JOINED = "NodeJoined"
REBALANCE = "Rebalance"
SCALE_DOWN = "ScaleDown"
SPEC_CHANGED = "SpecChanged"
# The same nodes again: the workers made no progress for Settings.stall_s (a generation whose
# collectives timed out with every member still alive waits for a newer plan, and nothing
# else would publish one). Workers act on it at once: no step boundary is coming.
STALLED = "Stalled"
# Reasons the workers act on at once; the others wait for the end of the current step.
URGENT_REASONS = frozenset({NODE_LOST, SPOT_NOTICE})


@dataclass(frozen=True)
class Settings:
    # Before the first plan, wait this long after enough nodes have joined for the rest of
    # the target to join too, so generation 1 uses them instead of growing at once.
    start_grace_s: float = 10.0
    # Recovery probability is reported for k = 1..max_failures simultaneous node failures.
    max_failures: int = 5
    # Publish the same nodes again when a plan has seen no progress for this long (0: never).
    stall_s: float = 0.0


# --- events in ---------------------------------------------------------------------------

@dataclass(frozen=True)
class NodesLost:
    """Workers on these nodes are gone (node deleted or NotReady, pod deleted, failed, evicted)."""
    names: tuple[str, ...]


@dataclass(frozen=True)
class SpotNotice:
    """These nodes will be reclaimed soon but are still alive."""
    names: tuple[str, ...]


@dataclass(frozen=True)
class NodesJoined:
    """A worker is up on each of these nodes and can be given a place in the plan."""
    nodes: tuple[NodeSpec, ...]


@dataclass(frozen=True)
class Progress:
    """A completed step, reported by the workers running plan ``generation``."""
    step: int
    generation: int
    # Tokens routed to each expert, per layer, since the last report (None: not measured).
    loads: tuple[tuple[int, ...], ...] | None = None
    checkpoint_step: int | None = None


@dataclass(frozen=True)
class RebalanceDue:
    """Check now whether re-allocating replicas to the measured loads is worth it."""


@dataclass(frozen=True)
class SpecChanged:
    spec: JobSpec


@dataclass(frozen=True)
class Tick:
    """Time has passed; lets the core act on deadlines it asked for (``Outcome.retry_at``)."""


Event = Union[NodesLost, SpotNotice, NodesJoined, Progress, RebalanceDue, SpecChanged, Tick]


# --- decisions out -----------------------------------------------------------------------

@dataclass(frozen=True)
class PublishPlan:
    plan: Plan
    # None for generation 1; otherwise what moves where, and what no survivor holds.
    migration: Migration | None
    message: str


@dataclass(frozen=True)
class RestoreCheckpoint:
    """Some expert lost every replica: the workers of ``generation`` reload a checkpoint."""
    generation: int
    step: int | None  # None: no checkpoint yet, start again from step 0
    lost: tuple[tuple[int, int], ...]  # (layer, expert)
    message: str


@dataclass(frozen=True)
class ReleaseWorkers:
    """These nodes' workers are no longer in the plan and may be stopped."""
    names: tuple[str, ...]


@dataclass(frozen=True)
class Wait:
    """Nothing can be published yet; the backend should say why and try again later."""
    reason: str
    message: str


Decision = Union[PublishPlan, RestoreCheckpoint, ReleaseWorkers, Wait]


# --- state -------------------------------------------------------------------------------

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
    # The latest plan the workers are known to hold: generation 1, a plan they reported a
    # step under, or one they restored a checkpoint into. Until the current plan is
    # confirmed, its migration may be half done, so only what both plans place on a node is
    # sure to be there (see ``_sure_holdings``).
    held: Plan | None = None
    # Nodes whose worker died since ``held`` was confirmed. A worker that comes back on such
    # a node starts empty, so it is no source of expert state.
    departed: frozenset[str] = frozenset()
    step: int = 0  # last completed step
    checkpoint_step: int | None = None
    loads: tuple[tuple[int, ...], ...] | None = None
    last_rebalance_step: int = 0
    # Generation of the latest progress report; None until the job has reported a step.
    progress_generation: int | None = None
    # A non-urgent change waiting for the next step boundary (its plan reason).
    pending: str | None = None
    # When enough nodes for a first plan had joined (start grace).
    ready_since: float | None = None
    restores: int = 0
    # The latest reconfiguration: a restore was needed, and what was lost.
    last_lost: tuple[tuple[int, int], ...] = ()
    last_experts_migrated: int = 0
    changed_at: float | None = None
    # When the latest progress report arrived.
    progress_at: float | None = None
    # The workers trained spec.steps steps and stopped: nothing is re-planned any more.
    finished: bool = False
    settings: Settings = field(default_factory=Settings)

    @property
    def alive(self) -> frozenset[str]:
        return frozenset(n.name for n in self.nodes)

    @property
    def training(self) -> bool:
        return self.progress_generation is not None

    @property
    def stale(self) -> bool:
        """The published plan names a node whose worker is gone: the workers are stuck."""
        return self.plan is not None and any(
            n.name not in self.alive or n.name in self.departed for n in self.plan.nodes)

    def missing_workers(self, starting: int = 0) -> int:
        """Workers to start toward the target, given ``starting`` ones not yet up."""
        if self.finished:
            return 0
        usable = sum(1 for n in self.nodes if n.name not in self.noticed | self.draining)
        return max(0, self.spec.target_nodes - usable - starting)


@dataclass(frozen=True)
class Outcome:
    state: JobState
    decisions: tuple[Decision, ...] = ()
    # Call handle(state, Tick(), now) at this time if nothing else happens first.
    retry_at: float | None = None


def new_job(spec: JobSpec, settings: Settings = Settings()) -> JobState:
    return JobState(spec=spec, settings=settings)


def handle(state: JobState, event: Event, now: float) -> Outcome:
    """The next state and what to do about ``event``."""
    if state.finished and not isinstance(event, SpecChanged):
        return Outcome(state)  # its workers are gone on purpose: nothing to recover
    if isinstance(event, NodesLost):
        return _on_lost(state, set(event.names), now)
    if isinstance(event, SpotNotice):
        return _on_notice(state, set(event.names), now)
    if isinstance(event, NodesJoined):
        return _on_joined(state, event.nodes, now)
    if isinstance(event, Progress):
        return _on_progress(state, event, now)
    if isinstance(event, RebalanceDue):
        return _rebalance(state, now, force=True)
    if isinstance(event, SpecChanged):
        return _on_spec(state, event.spec, now)
    if isinstance(event, Tick):
        if state.plan is None:
            return _advance(state, now)
        return _on_stall(state, now) if _stalled(state, now) else Outcome(state)
    raise TypeError(f"not a controller event: {event!r}")


def handle_all(state: JobState, events: Iterable[Event], now: float) -> Outcome:
    """Several events at once (e.g. from one observation), decisions concatenated."""
    decisions: list[Decision] = []
    retry_at = None
    for event in events:
        out = handle(state, event, now)
        state = out.state
        decisions.extend(out.decisions)
        retry_at = out.retry_at
    # A Wait superseded by a later publication in the same batch is no longer true.
    if any(isinstance(d, PublishPlan) for d in decisions):
        last = max(i for i, d in enumerate(decisions) if isinstance(d, PublishPlan))
        decisions = [d for i, d in enumerate(decisions) if not (isinstance(d, Wait) and i < last)]
    return Outcome(state, tuple(decisions), retry_at)


def observe(state: JobState, live: Sequence[NodeSpec], noticed: Iterable[str]) -> list[Event]:
    """Events that turn ``state`` into what a level-triggered backend observes now.

    ``live`` are the nodes with a running worker; ``noticed`` the nodes under a spot notice.
    """
    live_names = {n.name for n in live}
    lost = tuple(sorted(state.alive - live_names))
    joined = tuple(n for n in sorted(live, key=lambda n: n.name) if n.name not in state.alive)
    notices = tuple(sorted((set(noticed) & live_names) - state.noticed))
    events: list[Event] = []
    if lost:
        events.append(NodesLost(lost))
    if notices:
        events.append(SpotNotice(notices))
    if joined:
        events.append(NodesJoined(joined))
    return events


# --- transitions -------------------------------------------------------------------------

def _on_lost(state: JobState, names: set[str], now: float) -> Outcome:
    names &= state.alive
    if not names:
        return Outcome(state)
    state = dataclasses.replace(
        state,
        nodes=tuple(n for n in state.nodes if n.name not in names),
        noticed=state.noticed - names,
        draining=state.draining - names,
        departed=state.departed | names,
    )
    if state.plan is None:
        return _advance(state, now)
    if not any(n.name in names for n in state.plan.nodes):
        return Outcome(state)  # only workers outside the plan: nothing to re-plan
    return _publish(state, NODE_LOST, now, f"lost {_names(names)}")


def _on_notice(state: JobState, names: set[str], now: float) -> Outcome:
    # Not filtered by ``alive``: a notice may come before the node's worker has joined, and
    # the node must then never enter a plan.
    names = names - state.noticed
    if not names:
        return Outcome(state)
    state = dataclasses.replace(state, noticed=state.noticed | names)
    if state.plan is None or not any(n.name in names for n in state.plan.nodes):
        return Outcome(state)
    return _publish(state, SPOT_NOTICE, now, f"spot notice on {_names(names)}")


def _on_joined(state: JobState, nodes: Sequence[NodeSpec], now: float) -> Outcome:
    fresh = [n for n in nodes if n.name not in state.alive]
    if not fresh:
        return Outcome(state)
    state = dataclasses.replace(state, nodes=state.nodes + tuple(fresh))
    if state.plan is None or state.stale:
        return _advance(state, now)
    if not _would_grow(state):
        return Outcome(state)
    if state.training:
        return Outcome(dataclasses.replace(state, pending=NODE_JOINED))
    return _publish(state, NODE_JOINED, now, f"{_names(n.name for n in fresh)} joined")


def _on_progress(state: JobState, p: Progress, now: float) -> Outcome:
    if p.step < state.step and p.generation <= (state.progress_generation or 0):
        return Outcome(state)  # a late report from before the last one
    if state.spec.steps is not None and p.step >= state.spec.steps:
        return Outcome(dataclasses.replace(
            state, step=p.step, progress_generation=p.generation, progress_at=now,
            finished=True, pending=None, draining=frozenset()))
    loads = _check_loads(state.spec, p.loads) if p.loads is not None else state.loads
    state = dataclasses.replace(
        state, step=p.step, loads=loads, progress_generation=p.generation, progress_at=now,
        checkpoint_step=p.checkpoint_step if p.checkpoint_step is not None else state.checkpoint_step,
    )
    decisions: list[Decision] = []
    if state.plan is not None and p.generation >= state.plan.generation:
        # The workers finished a step under the current plan: its migration is done.
        if state.held is not state.plan:
            state = dataclasses.replace(state, held=state.plan, departed=frozenset())
        if state.draining:
            decisions.append(ReleaseWorkers(tuple(sorted(state.draining))))
            state = dataclasses.replace(state, draining=frozenset())
    if state.pending is not None:
        reason = state.pending
        state = dataclasses.replace(state, pending=None)
        if _would_grow(state) or reason != NODE_JOINED:
            out = _publish(state, reason, now, "at the step boundary")
            return Outcome(out.state, tuple(decisions) + out.decisions, out.retry_at)
    out = _rebalance(state, now, force=False)
    return Outcome(out.state, tuple(decisions) + out.decisions, out.retry_at)


def _on_spec(state: JobState, spec: JobSpec, now: float) -> Outcome:
    old = state.spec
    frozen = [("experts", "spec.runtime.experts"), ("layers", "spec.runtime.layers"),
              ("gpus_per_node", "spec.gpusPerNode"), ("slots_per_gpu", "spec.slotsPerGpu")]
    changed = [path for attr, path in frozen if getattr(old, attr) != getattr(spec, attr)]
    if changed:
        raise SpecError([Violation(p, "ImmutableField",
                                   "cannot change while the job exists; create a new job")
                         for p in changed])
    state = dataclasses.replace(state, spec=spec)
    if state.finished:
        return Outcome(state)
    if state.plan is None or state.stale:
        return _advance(state, now)
    chosen = _choose(state)
    shape_changed = (spec.policy != state.plan.policy
                     or spec.min_replicas != state.plan.min_replicas)
    plan_names = {n.name for n in state.plan.nodes}
    if {n.name for n in chosen} == plan_names and not shape_changed:
        return Outcome(state)
    if len(chosen) < len(plan_names) and not shape_changed:
        return _publish(state, SCALE_DOWN, now, f"target is now {spec.target_nodes} nodes")
    if _would_grow(state) and not shape_changed and state.training:
        return Outcome(dataclasses.replace(state, pending=NODE_JOINED))
    return _publish(state, SPEC_CHANGED, now, "the spec changed")


def _advance(state: JobState, now: float) -> Outcome:
    """First plan, or a plan after the job stalled: publish once enough nodes are up."""
    usable = _usable(state)
    fewest = state.spec.fewest_nodes
    if len(usable) < fewest:
        wait = Wait("WaitingForNodes",
                    f"{len(usable)} of the {fewest} nodes the job needs have a running worker; "
                    f"waiting for capacity (spec.minNodes is {state.spec.min_nodes})")
        return Outcome(dataclasses.replace(state, ready_since=None), (wait,))
    if state.plan is not None:
        return _publish(state, NODE_JOINED, now, "enough nodes are back")
    ready_since = state.ready_since if state.ready_since is not None else now
    state = dataclasses.replace(state, ready_since=ready_since)
    deadline = ready_since + state.settings.start_grace_s
    if len(usable) < state.spec.target_nodes and now < deadline:
        wait = Wait("WaitingForNodes",
                    f"{len(usable)} of {state.spec.target_nodes} target nodes are up; starting "
                    f"with those in {deadline - now:.0f} s unless the rest join first")
        return Outcome(state, (wait,), retry_at=deadline)
    return _publish(state, INITIAL, now, f"starting on {len(_choose(state))} nodes")


def _stalled(state: JobState, now: float) -> bool:
    """No progress under the current plan for ``stall_s``, counted from its publication or
    the last report, whichever is later (an operator that just restarted counts from now)."""
    if not state.settings.stall_s or state.stale:
        return False  # a lost node's own re-plan is on its way
    since = max(state.progress_at or 0.0, state.changed_at or 0.0)
    return since > 0 and now - since >= state.settings.stall_s


def _on_stall(state: JobState, now: float) -> Outcome:
    return _publish(state, STALLED, now,
                    f"no progress for {state.settings.stall_s:.0f} s with every worker alive")


def _rebalance(state: JobState, now: float, force: bool) -> Outcome:
    spec = state.spec
    if state.plan is None or state.stale or state.loads is None:
        return Outcome(state)
    due = spec.rebalance_every_steps and state.step - state.last_rebalance_step >= spec.rebalance_every_steps
    if not (due or force):
        return Outcome(state)
    state = dataclasses.replace(state, last_rebalance_step=state.step)
    before = [list(l.replicas) for l in state.plan.layers]
    try:
        after = allocate_layers(_as_floats(state.loads), spec.layers, spec.experts,
                                sum(n.slots for n in state.plan.nodes), spec.min_replicas)
    except InfeasibleError:
        return Outcome(state)
    old, new = imbalance(before, state.loads), imbalance(after, state.loads)
    if old <= 0 or (old - new) * 100 < spec.rebalance_min_gain_percent * old:
        return Outcome(state)
    return _publish(state, REBALANCE, now,
                    f"load imbalance (max/mean per replica) {old:.2f} -> {new:.2f}")


def imbalance(replicas: Sequence[Sequence[int]], loads: Sequence[Sequence[int]]) -> float:
    """Worst layer's busiest replica load over its mean replica load (1.0 is perfect)."""
    worst = 0.0
    for r, t in zip(replicas, loads):
        total = sum(t)
        if total <= 0:
            continue
        mean = total / sum(r)
        worst = max(worst, max(te / re for te, re in zip(t, r)) / mean)
    return worst


# --- publishing --------------------------------------------------------------------------

def _publish(state: JobState, reason: str, now: float, why: str) -> Outcome:
    spec = state.spec
    chosen = _choose(state)
    if len(chosen) < spec.fewest_nodes:
        wait = Wait("WaitingForNodes",
                    f"{why}: only {len(chosen)} usable nodes, the job needs {spec.fewest_nodes}; "
                    f"waiting for capacity")
        return Outcome(state, (wait,))
    loads = _as_floats(state.loads) if state.loads is not None else None
    generation = state.plan.generation + 1 if state.plan else 1
    if state.plan is None:
        plan = plan_job(chosen, spec.experts, spec.layers, spec.min_replicas, spec.policy,
                        loads=loads, generation=generation, reason=reason,
                        max_failures=state.settings.max_failures)
        migration = None
    else:
        # replan() keeps the old plan's policy and f; a spec change may have altered them.
        basis = _sure_holdings(state)
        old = dataclasses.replace(basis, generation=state.plan.generation,
                                  policy=spec.policy, min_replicas=spec.min_replicas)
        sources = ({n.name for n in basis.nodes} & state.alive) - state.departed
        result = replan(old, chosen, reason, sources, loads,
                        max_failures=state.settings.max_failures)
        plan, migration = result.plan, result.migration
    in_plan = {n.name for n in plan.nodes}
    left_out = state.alive - in_plan
    # Released workers must stay until they have sent their experts (see module docstring).
    was_in_plan = {n.name for n in state.plan.nodes} if state.plan else set()
    draining = (state.draining | was_in_plan) & left_out
    moved = migration.experts_migrated if migration else 0
    lost = migration.lost if migration else ()
    message = (f"generation {generation} ({reason}): {why}; {len(plan.nodes)} nodes, "
               f"{moved} expert replicas to migrate")
    decisions: list[Decision] = [PublishPlan(plan, migration, message)]
    state = dataclasses.replace(state, plan=plan, pending=None, draining=draining,
                                last_lost=tuple(lost), last_experts_migrated=moved,
                                changed_at=now, ready_since=None)
    if generation == 1:
        state = dataclasses.replace(state, held=plan, departed=frozenset())
    if lost:
        step = state.checkpoint_step
        decisions.append(RestoreCheckpoint(
            generation, step, tuple(lost),
            f"generation {generation}: {len(lost)} (layer, expert) pairs lost every replica; "
            + (f"restoring the checkpoint of step {step}" if step is not None
               else "no checkpoint exists yet, restarting from step 0")))
        # Every worker reloads its experts for this plan from the checkpoint.
        state = dataclasses.replace(state, step=step or 0, restores=state.restores + 1,
                                    held=plan, departed=frozenset())
    if draining and not state.training:
        decisions.append(ReleaseWorkers(tuple(sorted(draining))))
        state = dataclasses.replace(state, draining=frozenset())
    return Outcome(state, tuple(decisions))


def _sure_holdings(state: JobState) -> Plan:
    """Per node, the experts it surely holds: a plan-shaped object for the migration planner
    (which reads only the placement), not a valid plan.

    Before the workers confirm the current plan, a node may still hold its ``held``
    placement or may already have switched (and dropped experts it no longer hosts), so only
    experts both plans put on it are sure. A node that joined since holds nothing sure.
    """
    held, current = state.held or state.plan, state.plan
    if held is current:
        return current
    now_on = {n.name: i for i, n in enumerate(current.nodes)}
    layers = []
    for li, layer in enumerate(held.layers):
        placement = []
        for i, node in enumerate(held.nodes):
            slots = layer.placement[i]
            if node.name in now_on:
                keep = set(current.layers[li].placement[now_on[node.name]])
                slots = tuple(e for e in slots if e in keep)
            placement.append(slots)
        layers.append(dataclasses.replace(layer, placement=tuple(placement)))
    return dataclasses.replace(held, layers=tuple(layers))


def _usable(state: JobState) -> list[NodeSpec]:
    return [n for n in state.nodes if n.name not in state.noticed]


def _choose(state: JobState) -> list[NodeSpec]:
    """The nodes the next plan uses: up to the target, keeping the current plan's nodes
    (they hold experts already), then on-demand before spot."""
    in_plan = {n.name for n in state.plan.nodes} if state.plan else set()
    usable = sorted(_usable(state),
                    key=lambda n: (n.name not in in_plan, n.capacity_type == "spot", n.name))
    return usable[:state.spec.target_nodes]


def _would_grow(state: JobState) -> bool:
    in_plan = {n.name for n in state.plan.nodes} if state.plan else set()
    return any(n.name not in in_plan for n in _choose(state))


def _check_loads(spec: JobSpec, loads) -> tuple[tuple[int, ...], ...]:
    if len(loads) != spec.layers or any(len(l) != spec.experts for l in loads):
        raise ValueError(f"loads: need {spec.layers} layers x {spec.experts} experts of "
                         f"token counts, got {[len(l) for l in loads]}")
    if any(not isinstance(t, int) or t < 0 for l in loads for t in l):
        raise ValueError("loads: token counts must be integers >= 0")
    return tuple(tuple(l) for l in loads)


def _as_floats(loads) -> list[list[float]] | None:
    # A layer that routed no tokens yet says nothing about load: treat it as uniform.
    return [[float(t) for t in l] if sum(l) > 0 else [1.0] * len(l) for l in loads]


def _names(names: Iterable[str]) -> str:
    names = sorted(names)
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


# --- status ------------------------------------------------------------------------------

def lowest_replicas(state: JobState) -> int | None:
    """The fewest live replicas any expert of any layer has under the current plan."""
    if state.plan is None:
        return None
    alive = state.alive - state.noticed
    lowest = None
    for layer in state.plan.layers:
        counts = [0] * state.plan.experts
        for node, slots in zip(state.plan.nodes, layer.placement):
            if node.name in alive:
                for e in slots:
                    counts[e] += 1
        lowest = min(counts) if lowest is None else min(lowest, min(counts))
    return lowest


def status(state: JobState, previous: Sequence[dict], now_iso: str,
           observed_generation: int | None = None) -> dict:
    """The LazarusJob ``status`` (minus backend-specific fields) for this state.

    ``previous`` are the current conditions: a condition whose status is unchanged keeps
    its lastTransitionTime, as the API conventions ask.
    """
    plan = state.plan
    ready_nodes = (sum(1 for n in plan.nodes if n.name in state.alive) if plan else 0)
    out = {
        "readyNodes": ready_nodes,
        "targetNodes": state.spec.target_nodes,
        "generation": plan.generation if plan else 0,
        "step": state.step,
        "checkpointRestores": state.restores,
    }
    if state.checkpoint_step is not None:
        out["checkpointStep"] = state.checkpoint_step
    lowest = lowest_replicas(state)
    if lowest is not None:
        out["lowestReplicas"] = lowest
    if plan and plan.recovery:
        # Percent strings: status stays float-free like the spec, and reads well in kubectl.
        out["recovery"] = {k: _percent(p) for k, p in plan.recovery.items()}
        k = "2" if "2" in plan.recovery else max(plan.recovery, key=int)
        out["recoveryProbability"] = f"{_percent(plan.recovery[k])} (k={k})"
    out["conditions"] = conditions(state, previous, now_iso, observed_generation)
    return out


def _percent(p: float) -> str:
    return f"{100 * p:.1f}%"


def conditions(state: JobState, previous: Sequence[dict], now_iso: str,
               observed_generation: int | None = None) -> list[dict]:
    plan = state.plan
    spec = state.spec
    usable = len(_usable(state))
    if state.finished:
        ready = ("False", SUCCEEDED,
                 f"trained {state.step} steps (spec.steps is {spec.steps}); the workers "
                 f"have stopped")
    elif plan is None:
        ready = ("False", "WaitingForNodes",
                 f"{usable} of {spec.fewest_nodes} needed nodes have a running worker; "
                 f"no plan is published yet")
    elif state.stale:
        ready = ("False", "WaitingForNodes",
                 f"generation {plan.generation} names a lost node and only {usable} usable "
                 f"nodes remain of the {spec.fewest_nodes} the job needs; add capacity or "
                 f"lower spec.minNodes")
    else:
        ready = ("True", "Running",
                 f"generation {plan.generation} runs on {len(plan.nodes)} of "
                 f"{spec.target_nodes} target nodes")
    if plan is None:
        reconf = ("False", "NotStarted", "no plan generation has been published yet")
    else:
        reconf = ("True", plan.reason,
                  f"generation {plan.generation} ({plan.reason}): "
                  f"{state.last_experts_migrated} expert replicas migrated")
    if state.last_lost:
        restore = ("True", "ExpertsLost",
                   f"generation {plan.generation}: {len(state.last_lost)} (layer, expert) pairs "
                   f"lost every replica; the workers restored the checkpoint of step "
                   f"{state.step} ({state.restores} restores so far)")
    else:
        restore = ("False", "AllExpertsSurvived",
                   "every expert kept a live replica through the latest reconfiguration")
    wanted = {"Ready": ready, "Reconfigured": reconf, "CheckpointRestored": restore}
    before = {c.get("type"): c for c in previous}
    out = []
    for ctype, (status_, reason, message) in wanted.items():
        prev = before.get(ctype)
        since = prev["lastTransitionTime"] if prev and prev.get("status") == status_ \
            and prev.get("lastTransitionTime") else now_iso
        cond = {"type": ctype, "status": status_, "reason": reason, "message": message,
                "lastTransitionTime": since}
        if observed_generation is not None:
            cond["observedGeneration"] = observed_generation
        out.append(cond)
    return out
