"""What the controller asks a backend to do, and the outcome of handling one event."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from ..plan import Plan
from .state import JobState


@dataclass(frozen=True)
class PublishPlan:
    """Publish ``plan``: which nodes train and where the expert replicas go. How the workers
    get there (what moves, whether a checkpoint is restored) is the coordinator's call."""
    plan: Plan
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


Decision = Union[PublishPlan, ReleaseWorkers, Wait]


@dataclass(frozen=True)
class Outcome:
    state: JobState
    decisions: tuple[Decision, ...] = ()
    # Call handle(state, Tick(), now) at this time if nothing else happens first.
    retry_at: float | None = None
