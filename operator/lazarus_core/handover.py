"""How the workers get from what they hold to a new plan generation.

One decision, made in one place: which expert replicas move from which holder to which
node, whether some expert lost every replica so that a checkpoint must be restored, and
which survivor hands the dense state to workers that hold nothing yet. The coordinator
makes it (locally the parent process, on a cluster the coordinator pod), because only it
knows what the workers really hold: the layout they all adopted last (an interrupted
reconfiguration leaves every survivor on it), or, after the coordinator itself was
replaced, what each worker reported when it said hello again. The controller never
forecasts it; it reads the outcome back from the progress reports.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .migration import transfers_for
from .plan import ExpertKey, Plan, Transfer


@dataclass(frozen=True)
class Held:
    """What one live worker holds: its experts per layer, as of the step it applied last."""
    experts: tuple[frozenset[int], ...]
    step: int


def held_under(plan: Plan, alive: set[str], step: int) -> dict[str, Held]:
    """What the workers of ``plan`` that are still ``alive`` hold once they adopted it."""
    return {node.name: Held(tuple(frozenset(layer.placement[i]) for layer in plan.layers), step)
            for i, node in enumerate(plan.nodes) if node.name in alive}


@dataclass(frozen=True)
class Handover:
    # First step to run under the new plan: the step after the last committed one, or after
    # the restored checkpoint (an interrupted step is redone: it was never committed).
    start_step: int
    transfers: tuple[Transfer, ...] = ()
    # Nodes out of the plan that still send expert state (spot notice).
    draining: tuple[str, ...] = ()
    # Set when some expert lost every replica: the checkpoint step every worker reloads
    # (0: no checkpoint exists, start again from the initial weights).
    restore_step: int | None = None
    lost: tuple[ExpertKey, ...] = ()
    # Plan nodes that hold no state yet, and the survivor that sends them the dense state.
    joiners: tuple[str, ...] = ()
    dense_source: str | None = None
    # A step committed by a coordinator that died before every worker saw the commit: those
    # that hold it prepared apply it first (see job_channel.Directive).
    roll_forward: int | None = None

    @property
    def experts_migrated(self) -> int:
        return len(self.transfers)


def plan_handover(held: Mapping[str, Held], new: Plan, committed: int,
                  checkpoint_step: int | None, roll_forward: int | None = None) -> Handover:
    """The handover to ``new``. ``held``: what each live worker holds (a node out of ``new``
    but alive still sends, as under a spot notice). ``committed``: the job's last committed
    step; a worker that holds an older step holds nothing usable. ``checkpoint_step``: the
    newest complete checkpoint, if any."""
    sources = {n: h for n, h in held.items() if h.step == committed}
    if not sources and committed == 0:
        return Handover(start_step=1)  # nothing trained yet: everyone starts from the seed
    migration = transfers_for({n: h.experts for n, h in sources.items()}, new)
    if migration.lost:
        restored = checkpoint_step or 0
        return Handover(start_step=restored + 1, restore_step=restored, lost=migration.lost)
    in_plan = {n.name for n in new.nodes}
    joiners = tuple(sorted(in_plan - set(sources)))
    senders = {t.source for t in migration.transfers}
    # Any survivor holds the same dense state; one in the plan stays around to send it.
    staying = set(sources) & in_plan
    dense_source = min(staying or sources) if joiners else None
    if dense_source is not None:
        senders.add(dense_source)
    return Handover(start_step=committed + 1, transfers=migration.transfers,
                    draining=tuple(sorted(senders - in_plan)), joiners=joiners,
                    dense_source=dense_source, roll_forward=roll_forward)


def resume_point(reports: Mapping[str, tuple[int, int | None]]) -> tuple[int, int | None]:
    """(committed step, step to roll forward or None) from what reconnecting workers report,
    each as (last step applied, step prepared but not applied).

    A coordinator commits a step only once every member prepared it, so when it dies the
    members that missed the commit hold that very step prepared: the job's committed step
    is the highest any member applied, and those one behind can catch up by applying it."""
    if not reports:
        return 0, None
    committed = max(step for step, _ in reports.values())
    behind = any(step == committed - 1 and prepared == committed
                 for step, prepared in reports.values())
    return committed, committed if behind else None


def caught_up(step: int, prepared: int | None, roll_forward: int | None) -> int:
    """The step a worker holds once it applied the roll-forward it could."""
    return roll_forward if roll_forward is not None and prepared == roll_forward \
        and step == roll_forward - 1 else step

