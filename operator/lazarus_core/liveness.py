"""Which workers are alive, judged by the coordinator from what the workers themselves say.

Kubernetes learns that a node vanished only when its Node object turns NotReady (40 s by
default) or is deleted, and nothing in Kubernetes notices a worker that is alive but makes
no progress. The workers know sooner: each sends a heartbeat from a thread of its own,
apart from the training loop, every ``BEAT_S``; and a survivor whose collective failed
because a peer vanished says so at once. From these the coordinator declares a worker lost:

- **silent**: no heartbeat for ``SILENT_S`` (a frozen process, a vanished node whose
  sockets never closed), or for ``SUSPECT_S`` once a peer reported a failure (a SIGKILLed
  process closes its sockets and stops beating at once, so a short bound is safe then);
- **hung**: the heartbeat still comes, but the worker's training loop has not moved for
  longer than a step can take: ``max(HANG_FLOOR_S, HANG_STEPS x`` the recent median step
  time``)``. A slow step is not a hang: a step five times slower than usual is far inside
  that bound, so it never costs a re-plan.

A lost worker that starts beating again (SIGCONT after a SIGSTOP) is alive again: the
controller takes it back as a joining worker, and it receives the state it missed.

Pure: the caller passes the clock. The same tracker serves the local backend and the
coordinator pod, so both backends detect failures the same way.
"""
from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

BEAT_S = 0.2
SILENT_S = 3.0
SUSPECT_S = 1.0
# A reported peer failure makes the short bound apply for this long.
SUSPICION_S = 5.0
HANG_FLOOR_S = 8.0
HANG_STEPS = 20
# A worker's loop may rightly stand still this long outside the steps: building the model,
# adopting a plan (transfers bounded by the collective timeout), writing a checkpoint.
BUSY_LIMIT_S = 300.0


@dataclass(frozen=True)
class Beat:
    """One heartbeat: a counter that grows with every beat, how long the worker's training
    loop has not moved (by the worker's own clock: a duration, not a time), and whether the
    loop is inside a step (only then does the step time bound it)."""
    count: int
    busy_s: float
    in_step: bool = True


@dataclass
class _Seen:
    count: int
    at: float  # when the coordinator saw the count change
    busy_s: float
    in_step: bool


class Liveness:
    def __init__(self, silent_s: float = SILENT_S, suspect_s: float = SUSPECT_S,
                 hang_floor_s: float = HANG_FLOOR_S, hang_steps: int = HANG_STEPS):
        self.silent_s, self.suspect_s = silent_s, suspect_s
        self.hang_floor_s, self.hang_steps = hang_floor_s, hang_steps
        self._seen: dict[str, _Seen] = {}
        self._first: dict[str, float] = {}  # when this tracker first heard each member
        self._suspicion_at: float | None = None
        self._step_s: deque[float] = deque(maxlen=50)

    def beat(self, member: str, beat: Beat | None, now: float) -> None:
        """Record what ``member``'s heartbeat key holds now (None: never beat yet)."""
        if beat is None:
            return
        self._first.setdefault(member, now)
        seen = self._seen.get(member)
        if seen is None or beat.count != seen.count:
            self._seen[member] = _Seen(beat.count, now, beat.busy_s, beat.in_step)

    def heard(self, member: str) -> bool:
        """Whether ``member`` has beaten since this tracker started."""
        return member in self._seen

    def peer_failed(self, now: float) -> None:
        """A survivor reported a collective that failed because a peer went away."""
        self._suspicion_at = now

    def step_took(self, seconds: float) -> None:
        self._step_s.append(seconds)

    def hang_bound_s(self) -> float:
        typical = statistics.median(self._step_s) if self._step_s else 0.0
        return max(self.hang_floor_s, self.hang_steps * typical)

    def lost(self, members: Iterable[str], now: float) -> dict[str, str]:
        """The members to treat as lost now, each with the reason, in our words."""
        out = {}
        suspicious = (self._suspicion_at is not None
                      and now - self._suspicion_at <= SUSPICION_S)
        for m in members:
            seen = self._seen.get(m)
            if seen is None:
                continue  # not beating yet: still starting, judged by the process's fate
            quiet = now - seen.at
            if suspicious and quiet >= self.suspect_s:
                out[m] = f"no heartbeat for {quiet:.1f} s after a peer failure was reported"
            elif quiet >= self.silent_s:
                out[m] = f"no heartbeat for {quiet:.1f} s"
            else:
                bound = self.hang_bound_s() if seen.in_step else BUSY_LIMIT_S
                # Counted from when this tracker first heard the worker at the earliest: a
                # coordinator that just restarted meets loops that stood still while it was
                # gone (waiting for it, or on a peer that died with it), and judged by their
                # own clocks it took three healthy survivors for hung (11 s to recover).
                busy = min(seen.busy_s + quiet, now - self._first[m])
                if busy >= bound:
                    out[m] = (f"alive but its training loop has not moved for {busy:.0f} s "
                              f"(bound {bound:.0f} s)")
        return out
