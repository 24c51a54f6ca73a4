"""Passes over one job never overlap, and timers that ask for more passes.

Events that arrive during a pass coalesce into one more pass after it (``request``), which
keeps a burst of pod events from becoming a burst of re-plans. Each job also gets a
settling window for node changes (a pass once they pause, which every request made
meanwhile waits for, see ``request_when_quiet``; a pass can ask whether any came while it
ran, ``changed_since``), a retry at the deadline the controller asked for, and a periodic
pass (the heartbeat), each a one-shot timer that is replaced, never stacked.
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

Key = tuple[str, str]  # (namespace, job name)


@dataclass
class _Entry:
    guard: threading.Lock = field(default_factory=threading.Lock)
    dirty: bool = False
    running: bool = False
    timers: dict[str, threading.Timer] = field(default_factory=dict)
    # When the changes a pending quiet timer gathers began (see ``request_when_quiet``).
    first_change: dict[str, float] = field(default_factory=dict)
    # When the latest change of each kind came (see ``changed_since``).
    last_change: dict[str, float] = field(default_factory=dict)


class JobQueue:
    def __init__(self, run_pass: Callable[[str, str], None]):
        self._run_pass = run_pass
        self._entries: dict[Key, _Entry] = {}
        self._guard = threading.Lock()

    def _entry(self, key: Key) -> _Entry:
        with self._guard:
            return self._entries.setdefault(key, _Entry())

    def request(self, namespace: str, name: str) -> None:
        """A pass now, or once more right after the pass already running for this job. While
        changes are being gathered (``request_when_quiet``), the pass their window ends with
        is this one too: a pass before it would see only some of them."""
        entry = self._entry((namespace, name))
        with entry.guard:
            entry.dirty = True
            if entry.running or entry.first_change:
                return
            entry.running = True
        try:
            while True:
                with entry.guard:
                    if not entry.dirty or entry.first_change:
                        entry.running = False
                        return
                    entry.dirty = False
                self._run_pass(namespace, name)
        except BaseException:
            with entry.guard:
                entry.running = False
            raise

    def request_after(self, namespace: str, name: str, delay: float, kind: str, *,
                      before: Callable[[], None] = lambda: None) -> None:
        """A pass in ``delay`` seconds, as the one timer of this ``kind``: it replaces a
        pending one. ``before`` runs first, on the timer's thread."""
        entry = self._entry((namespace, name))

        def fire() -> None:
            before()
            self.request(namespace, name)

        with entry.guard:
            pending = entry.timers.get(kind)
            if pending is not None and pending.is_alive():
                pending.cancel()
            timer = threading.Timer(max(0.0, delay), fire)
            timer.daemon = True
            entry.timers[kind] = timer
            timer.start()

    def request_when_quiet(self, namespace: str, name: str, quiet: float, longest: float,
                           kind: str) -> None:
        """A pass once no change of this ``kind`` came for ``quiet`` seconds, and at the
        latest ``longest`` seconds after the first change it gathers (so that a stream of
        changes cannot keep postponing the pass)."""
        entry = self._entry((namespace, name))

        def fire() -> None:
            with entry.guard:
                if entry.timers.get(kind) is not timer:
                    return  # replaced by a later change while it was due
                entry.first_change.pop(kind, None)
            self.request(namespace, name)

        with entry.guard:
            now = entry.last_change[kind] = time.monotonic()
            first = entry.first_change.setdefault(kind, now)
            pending = entry.timers.get(kind)
            if pending is not None:
                pending.cancel()
            timer = threading.Timer(max(0.0, min(now + quiet, first + longest) - now), fire)
            timer.daemon = True
            entry.timers[kind] = timer
            timer.start()

    def changed_since(self, namespace: str, name: str, kind: str, since: float) -> bool:
        """Whether a change of this ``kind`` came after ``since`` (``time.monotonic()``): a
        pass for it is then due, or already asked for."""
        entry = self._entry((namespace, name))
        with entry.guard:
            return entry.last_change.get(kind, -math.inf) > since

    def forget(self, namespace: str, name: str) -> None:
        with self._guard:
            entry = self._entries.pop((namespace, name), None)
        for timer in entry.timers.values() if entry is not None else ():
            timer.cancel()
