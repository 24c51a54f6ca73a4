"""How the workers get from the layout they hold to a new plan generation.

One decision, made in one place: which expert replicas move from which holder to which
node, whether some expert lost every replica so that a checkpoint must be restored, and
which survivor hands the dense state to workers that hold nothing yet. The coordinator
makes it (locally the parent process, on a cluster the coordinator pod), because only it
knows what the workers really hold: the last plan they all adopted, not the last one
published (an interrupted reconfiguration leaves every survivor on the adopted layout).
The controller never forecasts it; it reads the outcome back from the progress reports.
"""
from __future__ import annotations

from dataclasses import dataclass

from .migration import plan_transfers
from .plan import ExpertKey, Plan, Transfer


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

    @property
    def experts_migrated(self) -> int:
        return len(self.transfers)


def plan_handover(held: Plan | None, new: Plan, alive: set[str], committed: int,
                  checkpoint_step: int | None) -> Handover:
    """The handover to ``new`` from ``held``, the plan every worker adopted last (None
    before the first). ``alive``: nodes whose workers still run, in ``new`` or not (a node
    leaving under a spot notice still sends its experts). ``committed``: the last step the
    workers applied; ``checkpoint_step``: the newest complete checkpoint, if any."""
    if held is None:
        return Handover(start_step=committed + 1)
    sources = {n.name for n in held.nodes} & alive
    migration = plan_transfers(held, new, sources)
    if migration.lost:
        restored = checkpoint_step or 0
        return Handover(start_step=restored + 1, restore_step=restored, lost=migration.lost)
    in_plan = {n.name for n in new.nodes}
    joiners = tuple(sorted(in_plan - sources))
    senders = {t.source for t in migration.transfers}
    # Any survivor holds the same dense state; one in the plan stays around to send it.
    staying = sources & in_plan
    dense_source = min(staying or sources) if joiners else None
    if dense_source is not None:
        senders.add(dense_source)
    return Handover(start_step=committed + 1, transfers=migration.transfers,
                    draining=tuple(sorted(senders - in_plan)), joiners=joiners,
                    dense_source=dense_source)
