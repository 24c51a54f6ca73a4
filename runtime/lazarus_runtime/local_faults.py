"""Failures injected into a local job: which workers to strike, how, and when.

``--kill`` (``Fault``) names a step, and either a count of random plan workers or the
workers by name; with ``mid_reconfiguration`` the kill waits for the first plan published
at or after that step and strikes right after it, while the survivors regroup and move
experts. With ``freeze_s`` the workers are not killed but frozen (SIGSTOP: a hung driver, a
stuck GPU) and thawed that many seconds later. ``kill_every_s`` kills one random plan
worker at a fixed period of wall-clock time (the goodput benchmark). The choices are pure
(a seeded generator), the striking is the local backend's.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Victims = Callable[[], list[str]]  # the plan's workers that are alive now


@dataclass(frozen=True)
class Fault:
    """At ``step`` (as it starts), kill ``count`` random plan workers, or the ``names``
    (or freeze them for ``freeze_s`` seconds)."""

    step: int
    count: int = 0
    names: tuple[str, ...] = ()
    mid_reconfiguration: bool = False
    freeze_s: float | None = None


Strike = tuple[Fault, list[str]]  # a fault and the workers it hits


class FaultSchedule:
    def __init__(self, kills: Sequence[Fault], seed: int = 0, kill_every_s: float | None = None):
        self.pending = sorted(kills, key=lambda f: f.step)
        self.rng = random.Random(seed)
        self.kill_every_s = kill_every_s
        self.next_kill_at: float | None = None

    def as_step_begins(self, step: int, victims: Victims) -> list[Strike]:
        """The faults due as ``step`` begins, with the workers each hits."""
        return [(f, self._choose(f, victims)) for f in self._take(
            lambda f: f.step == step and not f.mid_reconfiguration)]

    def after_publish(self, start_step: int, victims: Victims) -> list[Strike]:
        """The mid-reconfiguration faults due once a plan starting at ``start_step`` is out."""
        return [(f, self._choose(f, victims)) for f in self._take(
            lambda f: f.mid_reconfiguration and f.step <= start_step)]

    def start_clock(self, now: float) -> None:
        if self.kill_every_s is not None:
            self.next_kill_at = now + self.kill_every_s

    def on_clock(self, now: float, victims: Victims) -> list[Strike]:
        """A kill of one random plan worker when the period is up (never the last one: the
        job could not go on); nothing otherwise."""
        if self.next_kill_at is None or now < self.next_kill_at:
            return []
        self.next_kill_at += self.kill_every_s
        alive = victims()
        return [(Fault(0, 1), [self.rng.choice(alive)])] if len(alive) > 1 else []

    def _take(self, due: Callable[[Fault], bool]) -> list[Fault]:
        taken = [f for f in self.pending if due(f)]
        self.pending = [f for f in self.pending if f not in taken]
        return taken

    def _choose(self, fault: Fault, victims: Victims) -> list[str]:
        if fault.names:
            return sorted(fault.names)
        alive = victims()
        return sorted(self.rng.sample(alive, min(fault.count, len(alive))))
