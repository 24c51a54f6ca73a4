"""Checkpoint-restart under torchrun itself: the baseline of ``bench_goodput``.

Each simulated node is one torchrun elastic agent (``python -m torch.distributed.run``,
``--nnodes 1:W``, one worker each, c10d rendezvous) running ``torchrun_trainer.py``. The
rendezvous store lives in this process, as it would on a stable host, so that no node loss
takes it down. Losing a node is a SIGKILL of its agent and its worker together. What follows
is torchrun's own doing: the dead worker's peers fail, their agents restart, the others see
nodes waiting and restart too, the rendezvous forms a new round, and every worker starts
afresh from the newest checkpoint.

The rendezvous settings are torchrun's, passed through ``--rdzv-conf``: by default a round
waits ``last_call_timeout`` (30 s) for more nodes whenever fewer than the maximum have joined,
as after every lost node, and a dead node is dropped once its keep-alives lapse
(``keep_alive_interval`` 5 s x ``keep_alive_max_attempt`` 3).
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch.distributed as dist

TRAINER = Path(__file__).resolve().parent / "torchrun_trainer.py"
# Rendezvous settings tuned for fast restarts: a 1 s last call and dead nodes dropped after
# 2 s of missed keep-alives. A round completes once minNodes have joined and the last call
# has passed, so with no last call at all the first survivor back would train alone and
# the others would force yet another restart.
FAST_RDZV = {"last_call_timeout": 1, "keep_alive_interval": 1, "keep_alive_max_attempt": 2}


@dataclass
class Events:
    """What the trainers reported, read incrementally from their events file."""

    path: Path
    offset: int = 0
    first_up: set[int] = field(default_factory=set)  # ranks of the first round up
    rounds: int = 0          # training rounds that restored (or started) and trained
    redone: int = 0          # steps completed again after a restore
    steps: list[tuple[int, float]] = field(default_factory=list)  # (step, time), all
    progress: list[tuple[int, float]] = field(default_factory=list)  # new steps only

    @property
    def best(self) -> int:
        """Final progress: the highest step completed."""
        return self.progress[-1][0] if self.progress else 0

    def read(self) -> None:
        if not self.path.exists():
            return
        with open(self.path) as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[:chunk.rfind("\n") + 1]
        self.offset += len(complete.encode())
        for line in complete.splitlines():
            e = json.loads(line)
            if e["event"] == "up" and e["restart"] == 0:
                self.first_up.add(e["rank"])
            elif e["event"] == "restored":
                self.rounds += 1
            elif e["event"] == "step":
                if e["step"] <= self.best:
                    self.redone += 1
                else:
                    self.progress.append((e["step"], e["t"]))
                self.steps.append((e["step"], e["t"]))


@dataclass
class TorchrunRun:
    steps_completed: int
    training_seconds: float
    failures: int
    restarts: int
    steps_redone: int
    recoveries: list[float]  # per recovered kill: seconds to the next completed step


def _agent(name: str, workers: int, port: int, rdzv: dict,
           env: dict, log: Path) -> subprocess.Popen:
    conf = ",".join(f"{k}={v}" for k, v in {"is_host": "false", **rdzv}.items())
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", f"--nnodes=1:{workers}",
         "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
         f"--rdzv-id={name}", f"--rdzv-conf={conf}", "--max-restarts=1000", str(TRAINER)],
        env=env, stdin=subprocess.DEVNULL, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def _kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL an agent and its workers (torchrun starts each in a session of its own)."""
    try:
        procs = psutil.Process(agent.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    agent.send_signal(signal.SIGKILL)
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    agent.wait()


def run_torchrun(manifest: Path, name: str, workers: int, kill_every_s: float,
                 duration_s: float, rdzv: dict, workdir: Path, seed: int = 0,
                 on_event=print) -> TorchrunRun:
    """Train ``manifest`` under torchrun with a SIGKILLed node every ``kill_every_s`` from
    when every worker is up, until the first new progress past ``duration_s`` (or no new
    progress for twice that: a baseline that restarts more often than it trains)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    events = Events(workdir / f"{name}.events")
    # Sharing the agent's store with the workers (torch's default) breaks restarts: workers
    # of a new round read the previous round's addresses and fail to connect
    # (pytorch/pytorch#135712; seen here with torch 2.15). Its documented opt-out is what a
    # torchrun user with restarts runs.
    env = dict(os.environ, BENCH_MANIFEST=str(manifest), BENCH_EVENTS=str(events.path),
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    agents = [_agent(name, workers, store.port, rdzv, env,
                     workdir / f"{name}.agent-{i}.log") for i in range(workers)]
    rng = random.Random(seed)
    kills: list[float] = []
    try:
        start = time.monotonic()
        while len(events.first_up) < workers:
            if time.monotonic() - start > 180:
                raise TimeoutError(f"{name}: torchrun workers not up within 180 s; see "
                                   f"{workdir}/{name}.agent-*.log")
            time.sleep(0.05)
            events.read()
        training_from = time.monotonic()
        while True:
            time.sleep(0.01)
            events.read()
            now = time.monotonic()
            past = [(s, t) for s, t in events.progress if t - training_from >= duration_s]
            if past:
                last_step, end = past[0]
                break
            if now - training_from >= 2 * duration_s:
                last_step, end = events.best, now
                break
            if now >= training_from + kill_every_s * (len(kills) + 1):
                alive = [a for a in agents if a.poll() is None]
                if len(alive) > 1:  # never the last one: the job could not go on
                    _kill_node(rng.choice(alive))
                    kills.append(time.monotonic())
                    on_event(f"killed a node (agent and worker), {len(alive) - 1} left")
        # A kill with no step after it before the run ended is not a recovery.
        recoveries = [min(t for _, t in events.steps if t > k) - k
                      for k in kills if any(t > k for _, t in events.steps)]
        return TorchrunRun(steps_completed=last_step, training_seconds=end - training_from,
                           failures=len(kills), restarts=max(events.rounds - 1, 0),
                           steps_redone=events.redone, recoveries=recoveries)
    finally:
        for agent in agents:
            _kill_node(agent)
