"""A worker's heartbeat: a thread of its own, with a connection of its own to the coordinator.

Kept apart from the training loop on purpose: a beat says the process is alive even while
the loop computes, and carries how long the loop itself has not moved (``tick``), so the
coordinator can tell a frozen process (no beats), a hung loop (beats, but a loop that stands
still far longer than a step takes) and a slow step (neither) apart
(``lazarus_core.liveness``). If the coordinator goes away the thread keeps trying to reach
its replacement; it never stops the worker.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from lazarus_core.liveness import BEAT_S, Beat

from .job_channel import CoordinatorLost, JobChannel

log = logging.getLogger("lazarus.heartbeat")


class Heartbeat:
    def __init__(self, connect: Callable[[], JobChannel], node: str,
                 interval_s: float = BEAT_S):
        """``connect()``: a new signed channel to the coordinator, on a connection of its own."""
        self._connect = connect
        self.node = node
        self.interval_s = interval_s
        self._moved_at = time.monotonic()
        self._in_step = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def tick(self) -> None:
        """The training loop moved (a wait turned, a phase ended)."""
        self._moved_at = time.monotonic()

    def in_step(self, inside: bool) -> None:
        """Whether the loop is inside a training step (only a step's time bounds a hang)."""
        self._in_step = inside
        self.tick()

    def _run(self) -> None:
        count, chan = 0, None
        while not self._stop.is_set():
            try:
                if chan is None:
                    chan = self._connect()
                count += 1
                chan.beat(self.node, Beat(count, round(time.monotonic() - self._moved_at, 3),
                                          self._in_step))
            except (CoordinatorLost, RuntimeError, OSError) as e:
                # The coordinator is being replaced; the worker's own reconnect says so.
                log.debug("%s: heartbeat paused: %s", self.node, e)
                chan = None
            self._stop.wait(self.interval_s)
