"""The job state machine: the next state, and what to do, for each event.

Timing rules (design.md, "Rebalancing"):
- a lost node is acted on at once: the workers are stuck until the new plan arrives; so is
  a lost GPU (its rank is gone, and the node's other ranks wait on it);
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

from ..balance import busiest_rank
from ..job_spec import JobSpec, SpecError, Violation
from ..topology import NodeSpec
from .decisions import Decision, Outcome, PublishPlan, ReleaseWorkers, Wait
from .events import (Event, GpusBack, GpusLost, NodesJoined, NodesLost, Progress,
                     RebalanceDue, SpecChanged, SpotNotice, Tick, WorkerFailed)
from .publishing import as_floats, choose, names, next_plan, publish, usable, would_grow
from .reasons import (GPU_LOST, INITIAL, NODE_JOINED, NODE_LOST, REBALANCE, SCALE_DOWN,
                      SPEC_CHANGED, SPOT_NOTICE, STALLED)
from .state import JobState


def handle(state: JobState, event: Event, now: float) -> Outcome:
    """The next state and what to do about ``event``."""
    if state.finished and not isinstance(event, SpecChanged):
        return Outcome(state)  # its workers are gone on purpose: nothing to recover
    if isinstance(event, NodesLost):
        return _on_lost(state, set(event.names), now)
    if isinstance(event, GpusLost):
        return _on_gpus_lost(state, event.nodes, now)
    if isinstance(event, GpusBack):
        return _on_gpus_back(state, event.nodes, now)
    if isinstance(event, SpotNotice):
        return _on_notice(state, set(event.names), now)
    if isinstance(event, NodesJoined):
        return _on_joined(state, event.nodes, now)
    if isinstance(event, Progress):
        return _on_progress(state, event, now)
    if isinstance(event, WorkerFailed):
        return _on_worker_failed(state, event, now)
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
    if state.start_retry_at is not None and state.start_retry_at > now:
        retry_at = min(retry_at or state.start_retry_at, state.start_retry_at)
    # A Wait superseded by a later publication in the same batch is no longer true.
    if any(isinstance(d, PublishPlan) for d in decisions):
        last = max(i for i, d in enumerate(decisions) if isinstance(d, PublishPlan))
        decisions = [d for i, d in enumerate(decisions) if not (isinstance(d, Wait) and i < last)]
    return Outcome(state, tuple(decisions), retry_at)


def _on_worker_failed(state: JobState, e: WorkerFailed, now: float) -> Outcome:
    """A worker that failed before its first step is not replaced at once: the same cause
    (a bad runtime section, an image that cannot run) would fail the next one too.

    The wait doubles per round of workers, not per worker: no worker starts during a
    backoff, so one that fails during it was started with the round that began it. Counted
    per worker, a job of 64 nodes would reach the longest wait after its first round, and
    how soon the second came would depend on how many failures one look at the pods saw."""
    if e.node in state.proven:
        return Outcome(state)  # a worker that trained, lost: NodesLost re-plans around it
    state = dataclasses.replace(state, start_failures=state.start_failures + 1,
                                start_error=e.message)
    if state.start_retry_at is not None and now < state.start_retry_at:
        return Outcome(state, retry_at=state.start_retry_at)
    backoffs, s = state.start_backoffs + 1, state.settings
    retry_at = now + min(s.start_backoff_s * 2 ** (backoffs - 1), s.start_backoff_max_s)
    return Outcome(dataclasses.replace(state, start_backoffs=backoffs, start_retry_at=retry_at),
                   retry_at=retry_at)


def _on_lost(state: JobState, lost: set[str], now: float) -> Outcome:
    lost &= state.alive
    if not lost:
        return Outcome(state)
    state = dataclasses.replace(
        state,
        proven=state.proven - lost,  # a worker there again must prove itself again
        nodes=tuple(n for n in state.nodes if n.name not in lost),
        noticed=state.noticed - lost,
        draining=state.draining - lost,
        departed=state.departed | lost,
    )
    if state.plan is None:
        return _advance(state, now)
    if not any(n.name in lost for n in state.plan.nodes):
        return Outcome(state)  # only workers outside the plan: nothing to re-plan
    return publish(state, NODE_LOST, now, f"lost {names(lost)}")


def _on_gpus_lost(state: JobState, shrunk: Sequence[NodeSpec], now: float) -> Outcome:
    known = {n.name: n for n in state.nodes}
    shrunk = [n for n in shrunk
              if n.name in known and not set(known[n.name].devices) <= set(n.devices)]
    if not shrunk:
        return Outcome(state)
    fewer = {n.name: n for n in shrunk}
    state = dataclasses.replace(state, nodes=tuple(fewer.get(n.name, n) for n in state.nodes))
    if state.plan is None:
        return _advance(state, now)
    gone = {f"{n.name} GPU {d}" for n in shrunk for d in set(known[n.name].devices)
            - set(n.devices)}
    if not any(n.name in fewer for n in state.plan.nodes):
        return Outcome(state)  # a node outside the plan: nothing to re-plan
    return publish(state, GPU_LOST, now, f"lost {names(gone)}")


def _on_gpus_back(state: JobState, grown: Sequence[NodeSpec], now: float) -> Outcome:
    """GPUs whose rank resumed: capacity that joins, at a step boundary while training."""
    known = {n.name: n for n in state.nodes}
    more = {n.name: n for n in grown
            if n.name in known and set(known[n.name].devices) < set(n.devices)}
    if not more:
        return Outcome(state)
    state = dataclasses.replace(state, nodes=tuple(more.get(n.name, n) for n in state.nodes))
    return _grown(state, now, f"GPUs of {names(more)} are back")


def _on_notice(state: JobState, noticed: set[str], now: float) -> Outcome:
    # Not filtered by ``alive``: a notice may come before the node's worker has joined, and
    # the node must then never enter a plan.
    noticed = noticed - state.noticed
    if not noticed:
        return Outcome(state)
    state = dataclasses.replace(state, noticed=state.noticed | noticed)
    if state.plan is None or not any(n.name in noticed for n in state.plan.nodes):
        return Outcome(state)
    return publish(state, SPOT_NOTICE, now, f"spot notice on {names(noticed)}")


def _on_joined(state: JobState, nodes: Sequence[NodeSpec], now: float) -> Outcome:
    fresh = [n for n in nodes if n.name not in state.alive]
    if not fresh:
        return Outcome(state)
    state = dataclasses.replace(state, nodes=state.nodes + tuple(fresh))
    return _grown(state, now, f"{names(n.name for n in fresh)} joined")


def _grown(state: JobState, now: float, why: str) -> Outcome:
    """Capacity joined (``state`` holds it): plan into it at the next step boundary while
    training, at once otherwise."""
    if state.plan is None or state.stale:
        return _advance(state, now)
    if not would_grow(state):
        return Outcome(state)
    if state.training:
        return Outcome(dataclasses.replace(state, pending=NODE_JOINED))
    return publish(state, NODE_JOINED, now, why)


def _on_progress(state: JobState, p: Progress, now: float) -> Outcome:
    if p.step < state.step and p.generation <= (state.progress_generation or 0):
        return Outcome(state)  # a late report from before the last one
    measured = dict(progress_generation=p.generation, progress_at=now,
                    experts_migrated=p.experts_migrated, restored_step=p.restored_step,
                    experts_lost=p.experts_lost, restores=max(state.restores, p.restores),
                    checkpoint_error=p.checkpoint_error,
                    checkpoint_failures=max(state.checkpoint_failures, p.checkpoint_failures))
    if state.spec.steps is not None and p.step >= state.spec.steps:
        return Outcome(dataclasses.replace(state, step=p.step, finished=True, pending=None,
                                           draining=frozenset(), **measured))
    loads = _check_loads(state.spec, p.loads) if p.loads is not None else state.loads
    state = dataclasses.replace(
        state, step=p.step, loads=loads, **measured,
        checkpoint_step=p.checkpoint_step if p.checkpoint_step is not None else state.checkpoint_step,
    )
    decisions: list[Decision] = []
    if state.plan is not None and p.generation >= state.plan.generation:
        # The workers finished a step under the current plan: every member adopted it, and
        # every member started fine.
        started = frozenset(n.name for n in state.plan.nodes)
        newly = started - state.proven
        state = dataclasses.replace(state, departed=frozenset(), proven=state.proven | started)
        if newly and state.start_failures:  # a new worker started fine: the cause is gone
            state = dataclasses.replace(state, start_failures=0, start_error=None,
                                        start_backoffs=0, start_retry_at=None)
        if state.draining:
            decisions.append(ReleaseWorkers(tuple(sorted(state.draining))))
            state = dataclasses.replace(state, draining=frozenset())
    if state.pending is not None:
        reason = state.pending
        state = dataclasses.replace(state, pending=None)
        if would_grow(state) or reason != NODE_JOINED:
            out = publish(state, reason, now, "at the step boundary")
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
    chosen = choose(state)
    shape_changed = (spec.policy != state.plan.policy
                     or spec.min_replicas != state.plan.min_replicas)
    plan_names = {n.name for n in state.plan.nodes}
    if {n.name for n in chosen} == plan_names and not shape_changed:
        return Outcome(state)
    if len(chosen) < len(plan_names) and not shape_changed:
        return publish(state, SCALE_DOWN, now, f"target is now {spec.target_nodes} nodes")
    if would_grow(state) and not shape_changed and state.training:
        return Outcome(dataclasses.replace(state, pending=NODE_JOINED))
    return publish(state, SPEC_CHANGED, now, "the spec changed")


def _advance(state: JobState, now: float) -> Outcome:
    """First plan, or a plan after the job stalled: publish once enough nodes are up."""
    up = usable(state)
    fewest = state.spec.fewest_nodes
    if len(up) < fewest:
        wait = Wait("WaitingForNodes",
                    f"{len(up)} of the {fewest} nodes the job needs have a running worker; "
                    f"waiting for capacity (spec.minNodes is {state.spec.min_nodes})")
        return Outcome(dataclasses.replace(state, ready_since=None), (wait,))
    if state.plan is not None:
        return publish(state, NODE_JOINED, now, "enough nodes are back")
    ready_since = state.ready_since if state.ready_since is not None else now
    state = dataclasses.replace(state, ready_since=ready_since)
    deadline = ready_since + state.settings.start_grace_s
    if len(up) < state.spec.target_nodes and now < deadline:
        wait = Wait("WaitingForNodes",
                    f"{len(up)} of {state.spec.target_nodes} target nodes are up; starting "
                    f"with those in {deadline - now:.0f} s unless the rest join first")
        return Outcome(state, (wait,), retry_at=deadline)
    return publish(state, INITIAL, now, f"starting on {len(choose(state))} nodes")


def _stalled(state: JobState, now: float) -> bool:
    """No progress under the current plan for ``stall_s``, counted from its publication or
    the last report, whichever is later (an operator that just restarted counts from now).

    Not before the job's first step: its workers are starting (pulling an image, importing
    torch), which may take longer than any stall bound, and the same nodes published again
    start them no sooner. A stall plan then only makes workers that just formed their group
    form another, and a node lost in that moment cost the survivors a rendezvous timeout
    (the 30 s of a failed CI run)."""
    if not state.settings.stall_s or state.stale or state.step == 0:
        return False  # a lost node's own re-plan is on its way, or the job is starting
    since = max(state.progress_at or 0.0, state.changed_at or 0.0)
    return since > 0 and now - since >= state.settings.stall_s


def _on_stall(state: JobState, now: float) -> Outcome:
    return publish(state, STALLED, now,
                   f"no progress for {state.settings.stall_s:.0f} s with every worker alive")


def _rebalance(state: JobState, now: float, force: bool) -> Outcome:
    """A new generation for the measured loads, only if it brings the busiest rank down by
    at least ``rebalanceMinGainPercent``: judged on the plan the solver would make (which
    also weighs recovery and may trade counts), so a plan already as good is never
    published again."""
    spec = state.spec
    if state.plan is None or state.stale or state.loads is None:
        return Outcome(state)
    due = spec.rebalance_every_steps and state.step - state.last_rebalance_step >= spec.rebalance_every_steps
    if not (due or force):
        return Outcome(state)
    state = dataclasses.replace(state, last_rebalance_step=state.step)
    loads = as_floats(state.loads)
    old = busiest_rank(state.plan, loads)
    gain = spec.rebalance_min_gain_percent / 100
    if gain >= 1 or old * (1 - gain) < 1:
        return Outcome(state)  # not even perfect balance would gain enough
    candidate = next_plan(state, REBALANCE, "rebalance")
    if isinstance(candidate, Wait):
        return Outcome(state)
    new = busiest_rank(candidate, loads)
    if new >= old or (old - new) < gain * old:
        return Outcome(state)
    return publish(state, REBALANCE, now, f"busiest rank over the mean {old:.2f} -> {new:.2f}",
                   candidate)


def _check_loads(spec: JobSpec, loads) -> tuple[tuple[int, ...], ...]:
    if len(loads) != spec.layers or any(len(l) != spec.experts for l in loads):
        raise ValueError(f"loads: need {spec.layers} layers x {spec.experts} experts of "
                         f"token counts, got {[len(l) for l in loads]}")
    if any(not isinstance(t, int) or t < 0 for l in loads for t in l):
        raise ValueError("loads: token counts must be integers >= 0")
    return tuple(tuple(l) for l in loads)
