"""What a backend tells the controller: the events it turns its observations into."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Union

from ..job_spec import JobSpec
from ..topology import NodeSpec
from .state import JobState


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
    """A completed step, reported by the coordinator of the workers running ``generation``.

    Besides the step, it carries what the coordinator measured bringing the workers to that
    generation (it decides transfers and restores, because only it sees what the workers
    hold): the controller reports these facts, it does not forecast them."""
    step: int
    generation: int
    # Tokens routed to each expert, per layer, since the last report (None: not measured).
    loads: tuple[tuple[int, ...], ...] | None = None
    checkpoint_step: int | None = None
    # Expert replicas the workers fetched from their peers to adopt ``generation``.
    experts_migrated: int = 0
    # Set when some expert had lost every replica: the checkpoint step the workers restored
    # (0: none existed, they started again from the initial weights).
    restored_step: int | None = None
    # (layer, expert) pairs without a surviving replica, when ``restored_step`` is set.
    experts_lost: int = 0
    # Checkpoint restores of the whole run so far.
    restores: int = 0
    # Why the latest checkpoint was skipped (a storage fault; training went on), or None
    # when it was written or none was due yet; and how many were skipped so far.
    checkpoint_error: str | None = None
    checkpoint_failures: int = 0


@dataclass(frozen=True)
class WorkerFailed:
    """The worker on ``node`` exited with an error (a lost node is NodesLost): ``message``
    is what it said last. Before its first completed step, it failed to start."""
    node: str
    message: str


@dataclass(frozen=True)
class RebalanceDue:
    """Check now whether re-allocating replicas to the measured loads is worth it."""


@dataclass(frozen=True)
class SpecChanged:
    spec: JobSpec


@dataclass(frozen=True)
class Tick:
    """Time has passed; lets the core act on deadlines it asked for (``Outcome.retry_at``)."""


Event = Union[NodesLost, SpotNotice, NodesJoined, Progress, WorkerFailed, RebalanceDue,
              SpecChanged, Tick]


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
