"""The node agent: the small process in each worker pod that runs the node's rank processes.

    python -m lazarus_runtime.node_agent [-- COMMAND ...]   (configured by the environment)

A node (a pod, a failure domain) trains with one rank per GPU. The agent starts
``gpusPerNode`` rank processes, the Lazarus worker unless a COMMAND wraps it (a profiler,
say), each pinned to its own GPU through CUDA_VISIBLE_DEVICES (``devices.place_ranks``;
with more ranks than GPUs they share, over gloo; with none, they run on the CPU). Then it
supervises them:

- a rank that dies is reported to the coordinator at once (``JobChannel.rank_exited``; its
  heartbeats would say so within seconds anyway), and the node's other ranks keep
  training: the coordinator finds the rank lost, the controller re-plans without that GPU's
  slots;
- nothing is ever restarted here: a rank back from the dead would not hold what the plan
  says it holds, and the controller decides where replicas go;
- SIGTERM and SIGINT are passed on to the ranks, which leave as they would alone;
- if the agent itself dies, its ranks die with it (``PR_SET_PDEATHSIG``), so a node is lost
  whole, as Kubernetes sees it, never half.

It exits once every rank has: 0 when some rank finished normally (the job ended, or the
plan released the node), otherwise the exit status of the first rank that failed. The ranks'
stderr passes through the agent line by line, and the agent's last line names the first
failed rank's last words: a pod's termination message is its log's tail, and its last line
is what the operator quotes when workers fail to start (a rank's own error would otherwise
be buried under the agent's report of it).
"""
from __future__ import annotations

import ctypes
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from lazarus_core import process_env as penv
from lazarus_core.plan import member_name

from .devices import RankDevice, collective_backend, place_ranks, visible_gpus

log = logging.getLogger("lazarus.agent")

WORKER_COMMAND = (sys.executable, "-m", "lazarus_runtime.worker")
_POLL_S = 0.05
_PR_SET_PDEATHSIG = 1  # linux/prctl.h

# A rank's last words, as much of its last line of stderr as a condition message can take.
LAST_WORDS_CHARS = 400

# (local rank, its exit status: negative for a signal, as subprocess reports it, and its
# last line of stderr)
OnRankExit = Callable[[int, int, str], None]


class NodeAgent:
    def __init__(self, ranks: Sequence[RankDevice], backend: str, environ: Mapping[str, str],
                 command: Sequence[str] = WORKER_COMMAND,
                 on_rank_exit: OnRankExit = lambda local_rank, code, last_words: None):
        self.ranks = list(ranks)
        self.backend = backend
        self.environ = dict(environ)
        self.command = list(command)
        self.on_rank_exit = on_rank_exit
        self.procs: dict[int, subprocess.Popen] = {}
        self.exits: dict[int, int] = {}  # local rank -> exit status, in the order seen
        self.last_words: dict[int, str] = {}  # local rank -> its last line of stderr
        self._relays: dict[int, threading.Thread] = {}
        self._stderr = sys.stderr.buffer
        self._stderr_lock = threading.Lock()

    def start(self) -> "NodeAgent":
        for r in self.ranks:
            env = self.environ | penv.rank_env(r.local_rank, r.gpu, self.backend)
            proc = subprocess.Popen(self.command, env=env, stdin=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, preexec_fn=_die_with_parent)
            self.procs[r.local_rank] = proc
            self._relays[r.local_rank] = threading.Thread(
                target=self._relay, args=(r.local_rank, proc.stderr),
                name=f"rank-{r.local_rank}-stderr", daemon=True)
            self._relays[r.local_rank].start()
            log.info("rank %d started on %s (pid %d, %s)", r.local_rank,
                     f"GPU {r.gpu}" if r.gpu is not None else "the CPU",
                     self.procs[r.local_rank].pid, self.backend)
        return self

    def _relay(self, local_rank: int, pipe) -> None:
        """Pass a rank's stderr on, whole lines at a time, keeping its last words."""
        for line in iter(pipe.readline, b""):
            with self._stderr_lock:
                self._stderr.write(line)
                self._stderr.flush()
            if line.strip():
                self.last_words[local_rank] = (
                    line.decode(errors="replace").strip()[:LAST_WORDS_CHARS])

    def forward(self, signum: int) -> None:
        """Pass ``signum`` on to every rank still running."""
        for local_rank, proc in self.procs.items():
            if local_rank not in self.exits and proc.poll() is None:
                proc.send_signal(signum)

    def poll(self) -> bool:
        """Note the ranks that exited since the last look; True while some still run."""
        for local_rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None and local_rank not in self.exits:
                # Its pipe closes as it exits; a child it left behind may hold it open.
                self._relays[local_rank].join(timeout=1.0)
                self.exits[local_rank] = code
                self.on_rank_exit(local_rank, code, self.last_words.get(local_rank, ""))
        return len(self.exits) < len(self.procs)

    def run(self, poll_s: float = _POLL_S) -> int:
        """Supervise until every rank has exited; the agent's exit status."""
        while self.poll():
            time.sleep(poll_s)
        return self.exit_status()

    def exit_status(self) -> int:
        codes = list(self.exits.values())
        if 0 in codes:
            return 0
        first = codes[0]
        return 128 - first if first < 0 else first  # a signal, as a shell reports it

    def first_failure(self) -> str:
        """The first failed rank and its last words, for the agent's own last line."""
        local_rank, code = next((r, c) for r, c in self.exits.items() if c != 0)
        words = self.last_words.get(local_rank)
        return f"rank {local_rank} exited with status {code}" + (f": {words}" if words else "")


class ExitReporter:
    """Tells the coordinator that a rank exited, from a thread of its own: its connection
    (and the torch import it needs) is made while the ranks start, and a coordinator being
    replaced delays the report, never the agent."""

    RETRY_S = 0.5

    def __init__(self, coordinator: tuple[str, int], node: str, key: str, job: str,
                 pod_uid: str = ""):
        self.coordinator, self.node, self.pod_uid = coordinator, node, pod_uid
        self._signing = (key, job)
        self._pending: queue.Queue[tuple[int, int, str]] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="exit-reporter", daemon=True)

    def start(self) -> "ExitReporter":
        self._thread.start()
        return self

    def report(self, local_rank: int, status: int, last_words: str) -> None:
        self._pending.put((local_rank, status, last_words))

    def flush(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until every report is written."""
        deadline = time.monotonic() + timeout_s
        while self._pending.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def _run(self) -> None:
        import datetime

        import torch.distributed as dist

        from .job_channel import CoordinatorLost, JobChannel, RankExit

        host, port = self.coordinator
        chan = None
        while True:
            local_rank, status, last_words = self._pending.get()
            while True:
                try:
                    if chan is None:
                        chan = JobChannel(dist.TCPStore(
                            host, port, is_master=False, timeout=datetime.timedelta(seconds=5)),
                            *self._signing)
                    chan.rank_exited(member_name(self.node, local_rank),
                                     RankExit(status, last_words, self.pod_uid))
                    break
                except (CoordinatorLost, RuntimeError, OSError) as e:
                    log.debug("%s: could not report rank %d yet: %s", self.node, local_rank, e)
                    chan = None
                    time.sleep(self.RETRY_S)
            self._pending.task_done()


def _die_with_parent() -> None:
    """In a rank, before it runs: die with SIGKILL when the agent dies (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return  # no prctl: the pod's end still takes every process of the container


def _report(node: str, gpus: Mapping[int, str | None], reporter: ExitReporter) -> OnRankExit:
    def report(local_rank: int, code: int, last_words: str) -> None:
        where = f"GPU {gpus[local_rank]}" if gpus[local_rank] is not None else "the CPU"
        if code == 0:
            log.info("%s: rank %d (%s) finished", node, local_rank, where)
        else:
            log.warning("%s: rank %d (%s) exited with status %d (%s); the node's other ranks "
                        "go on, and the plan drops this one", node, local_rank, where, code,
                        last_words or "it said nothing")
        reporter.report(local_rank, code, last_words)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Configured by the environment of a worker pod, or of ``lazarus run --local``
    (``lazarus_core.process_env``); arguments after ``--`` replace the rank command."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    try:
        env = penv.read_agent_env(os.environ)
    except penv.EnvError as e:
        print(f"lazarus node agent: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=os.environ.get(penv.LOG_LEVEL) or "WARNING",
                        format="%(asctime)s %(name)s %(message)s")
    # CUDA_VISIBLE_DEVICES when set (the local backend's share of the machine), otherwise
    # every GPU the pod was given.
    ranks = place_ranks(env.ranks, visible_gpus(env.visible_gpus))
    backend = env.backend or collective_backend(ranks)
    reporter = ExitReporter(env.coordinator_address, env.node, env.key, env.job, env.pod_uid)
    agent = NodeAgent(ranks, backend, os.environ, args or WORKER_COMMAND,
                      on_rank_exit=_report(env.node, {r.local_rank: r.gpu for r in ranks},
                                           reporter))
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda s, _frame: agent.forward(s))
    agent.start()
    reporter.start()
    status = agent.run()
    reporter.flush(timeout_s=5.0)
    if status != 0:
        print(f"lazarus node agent: error: {agent.first_failure()}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
