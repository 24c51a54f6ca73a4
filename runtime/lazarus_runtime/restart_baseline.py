"""The checkpoint-restart baseline the benchmarks compare Lazarus with (what torchrun's
elastic agents do, without their rendezvous delays): on any death every worker restarts and
the job goes on from the last checkpoint.

It is the local job with one change. The survivors are stopped and as many fresh processes
start in their place (no replacement for the dead). The controller then sees every old node
lost and no expert keeps a replica, so the coordinator's handover restores the last
checkpoint, through the same directive as an unrecoverable loss.
"""
from __future__ import annotations

import time

from .local_backend import LocalJob


class RestartingLocalJob(LocalJob):
    def _on_deaths(self) -> None:
        survivors = [n for n in self.state.alive if self.procs[n].poll() is None]
        for n in survivors:
            self.procs[n].terminate()
        first = len(self.procs)
        fresh = [f"worker-{first + i}" for i in range(len(survivors))]
        for n in survivors:
            self.procs[n].wait()
        for n in fresh:
            self._spawn(n)
        self.admitted.update(fresh)
        self._await_hellos(fresh, time.monotonic())
        self.on_event(f"restarted {len(fresh)} workers from scratch")
