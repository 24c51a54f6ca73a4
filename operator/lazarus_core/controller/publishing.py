"""Making the next plan generation: which nodes it uses, and the plan the solver gives them."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from ..plan import Plan
from ..solver import plan_job, replan
from ..topology import NodeSpec
from .decisions import Decision, Outcome, PublishPlan, ReleaseWorkers, Wait
from .state import JobState


def next_plan(state: JobState, reason: str, why: str) -> Plan | Wait:
    """The plan the next generation would have on the chosen nodes, or Wait when too few
    are usable."""
    spec = state.spec
    chosen = choose(state)
    if len(chosen) < spec.fewest_nodes:
        return Wait("WaitingForNodes",
                    f"{why}: only {len(chosen)} usable nodes, the job needs {spec.fewest_nodes}; "
                    f"waiting for capacity")
    slots = sum(n.slots for n in chosen)
    if slots < spec.experts * spec.min_replicas:  # nodes that lost GPUs hold fewer slots
        return Wait("WaitingForNodes",
                    f"{why}: the usable GPUs hold {slots} expert slots, {spec.experts} experts "
                    f"x {spec.min_replicas} replicas need {spec.experts * spec.min_replicas}; "
                    f"waiting for capacity")
    loads = as_floats(state.loads) if state.loads is not None else None
    generation = state.plan.generation + 1 if state.plan else 1
    if state.plan is None:
        return plan_job(chosen, spec.experts, spec.layers, spec.min_replicas, spec.policy,
                        loads=loads, generation=generation, reason=reason,
                        max_failures=state.settings.max_failures)
    # Positions are mapped onto nodes to keep replicas where the current plan put them
    # (the coordinator then moves what is missing, from what the workers really hold).
    # replan() keeps the old plan's policy and f; a spec change may have altered them.
    old = dataclasses.replace(state.plan, policy=spec.policy, min_replicas=spec.min_replicas)
    sources = ({n.name for n in old.nodes} & state.alive) - state.departed
    return replan(old, chosen, reason, sources, loads,
                  max_failures=state.settings.max_failures,
                  move_price=spec.move_price_percent / 100).plan


def publish(state: JobState, reason: str, now: float, why: str,
            plan: Plan | None = None) -> Outcome:
    """The next generation on the chosen nodes (``plan``, when the caller has made it with
    ``next_plan``), or Wait when too few are usable."""
    if plan is None:
        made = next_plan(state, reason, why)
        if isinstance(made, Wait):
            return Outcome(state, (made,))
        plan = made
    generation = plan.generation
    in_plan = {n.name for n in plan.nodes}
    left_out = state.alive - in_plan
    # Released workers must stay until they have sent their experts (see transitions).
    was_in_plan = {n.name for n in state.plan.nodes} if state.plan else set()
    draining = (state.draining | was_in_plan) & left_out
    message = f"generation {generation} ({reason}): {why}; {len(plan.nodes)} nodes"
    decisions: list[Decision] = [PublishPlan(plan, message)]
    # A node back with a new worker is no longer "departed" once a plan takes it in anew.
    state = dataclasses.replace(state, plan=plan, pending=None, draining=draining,
                                departed=state.departed - in_plan, changed_at=now,
                                ready_since=None)
    if draining and not state.training:
        decisions.append(ReleaseWorkers(tuple(sorted(draining))))
        state = dataclasses.replace(state, draining=frozenset())
    return Outcome(state, tuple(decisions))


def usable(state: JobState) -> list[NodeSpec]:
    return [n for n in state.nodes if n.name not in state.noticed]


def choose(state: JobState) -> list[NodeSpec]:
    """The nodes the next plan uses: up to the target, keeping the current plan's nodes
    (they hold experts already), then on-demand before spot."""
    in_plan = {n.name for n in state.plan.nodes} if state.plan else set()
    ordered = sorted(usable(state),
                     key=lambda n: (n.name not in in_plan, n.capacity_type == "spot", n.name))
    return ordered[:state.spec.target_nodes]


def would_grow(state: JobState) -> bool:
    """The next plan would run ranks the current one does not: a new node, or a GPU of a
    plan node back from a lost rank."""
    in_plan = {(n.name, d) for n in state.plan.nodes for d in n.devices} if state.plan else set()
    return any((n.name, d) not in in_plan for n in choose(state) for d in n.devices)


def as_floats(loads) -> list[list[float]]:
    # A layer that routed no tokens yet says nothing about load: treat it as uniform.
    return [[float(t) for t in l] if sum(l) > 0 else [1.0] * len(l) for l in loads]


def names(nodes: Iterable[str]) -> str:
    ordered = sorted(nodes)
    return ", ".join(ordered[:5]) + (f" and {len(ordered) - 5} more" if len(ordered) > 5 else "")
