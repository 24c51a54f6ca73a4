"""The discrete-event engine: one training job replaying a trace.

Between trace events a job is in one of three states: training (whole steps, with a
partial step in flight), busy (checkpointing, reconfiguring, restarting: a fixed duration,
then a callback), or waiting for nodes. Training runs in closed form up to the next step
boundary where something is due (a checkpoint, or whatever the strategy schedules), so a
run costs one iteration per boundary or event, not per step.

Every second of the run lands in exactly one category of ``CATEGORIES``; compute that a
rollback throws away, and the partial step a failure interrupts, move from compute to lost.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import groupby

from lazarus_core.topology import NodeSpec
from .trace import Trace
from .workload import Costs, ModelSpec

CATEGORIES = ("compute", "reconfiguration", "checkpoint", "restart", "waiting", "lost")


@dataclass
class Result:
    strategy: str
    trace: str
    duration: float
    samples: int  # samples trained and kept at the end of the trace
    steps: int
    seconds: dict[str, float]  # category -> seconds; sums to duration
    curve: list[tuple[float, int]]  # (time, samples) whenever samples changed
    counts: Counter = field(default_factory=Counter)  # failures, restarts, checkpoints, ...


@dataclass
class _Busy:
    category: str
    end: float
    on_done: Callable[[], None]


class Job(ABC):
    """What every strategy shares: the clock, the ledger, checkpoints and rollbacks.

    A strategy sets ``members`` (the nodes training now; empty means waiting) and implements
    ``start``, ``react`` and ``step_seconds``; it may add its own step boundaries. No
    strategy runs a model that does not fit its nodes (``fits``), nor on more than
    ``world_size`` nodes.
    """

    name = ""

    def __init__(self, model: ModelSpec, costs: Costs, checkpoint_every: int, node: NodeSpec,
                 world_size: int):
        if checkpoint_every < 1:
            raise ValueError(f"strategies.{self.name}.checkpoint_every: must be >= 1, "
                             f"got {checkpoint_every}")
        if world_size < 1:
            raise ValueError(f"cluster.nodes: must be >= 1, got {world_size}")
        self.model, self.costs, self.checkpoint_every = model, costs, checkpoint_every
        self.node_template = node  # gpus and slots of every node the trace brings
        # The job's size (cluster.nodes): no strategy runs on more nodes than this.
        self.world_size = world_size
        self.t = 0.0
        self.busy: _Busy | None = None
        self.partial = 0.0  # seconds into the step in flight
        self.step = self.samples = 0
        self.saved_step = self.saved_samples = 0
        self.unsaved_compute = 0.0  # compute since the last checkpoint: lost on rollback
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self.curve: list[tuple[float, int]] = [(0.0, 0)]
        self.counts: Counter = Counter()
        self.alive: dict[str, NodeSpec] = {}
        self.members: list[NodeSpec] = []

    # --- what a strategy provides ------------------------------------------------------

    @abstractmethod
    def start(self, nodes: list[NodeSpec]) -> None:
        """Take the trace's first nodes."""

    @abstractmethod
    def react(self, lost: list[str], joined: list[str], noticed: list[str]) -> None:
        """Respond to the trace's changes at the current time."""

    @abstractmethod
    def step_seconds(self) -> float:
        """The time one training step takes on the current members."""

    def steps_to_own_boundary(self) -> int | None:
        """Steps until the strategy wants control at a step boundary (0 = now), or None."""
        return None

    def at_own_boundary(self) -> None:
        """Act at that boundary: start something busy, or make the boundary no longer due."""

    def after_checkpoint(self) -> None:
        """Called when a checkpoint is safely written."""

    # --- the engine --------------------------------------------------------------------

    @property
    def world(self) -> int:
        return sum(n.gpus for n in self.members)

    def fits(self, nodes: list[NodeSpec]) -> bool:
        """Can these nodes hold the model at all: one slot for every expert."""
        return sum(n.slots for n in nodes) >= self.model.experts

    def run(self, trace: Trace) -> Result:
        # The job starts at 0 with whatever the trace has then, even nothing (a window of a
        # spot trace can open with no instance): a strategy that cannot run yet waits.
        for e in trace.initial_nodes():
            self.alive[e.node] = self._node(e.node, e.zone)
        self.start(list(self.alive.values()))
        later = (e for e in trace.events if not (e.time == 0 and e.kind == "join"))
        for time, batch in groupby(later, key=lambda e: e.time):
            self.advance(time)
            self.handle(list(batch))
        self.advance(trace.duration)
        assert abs(sum(self.seconds.values()) - trace.duration) < 1e-6 * max(1.0, trace.duration)
        return Result(self.name, trace.label, trace.duration, self.samples, self.step,
                      dict(self.seconds), self.curve, self.counts)

    def _node(self, name: str, zone: str) -> NodeSpec:
        t = self.node_template
        return NodeSpec(name, t.gpus, t.slots_per_gpu, zone, t.capacity_type)

    def handle(self, batch) -> None:
        lost, joined, noticed = [], [], []
        for e in batch:
            if e.kind == "join" and e.node not in self.alive:
                self.alive[e.node] = self._node(e.node, e.zone)
                joined.append(e.node)
            elif e.kind == "lose" and e.node in self.alive:
                del self.alive[e.node]
                lost.append(e.node)
            elif e.kind == "notice" and e.node in self.alive:
                noticed.append(e.node)
        self.react(lost, joined, noticed)

    def advance(self, until: float) -> None:
        while self.t < until:
            if self.busy:
                end = min(self.busy.end, until)
                self.seconds[self.busy.category] += end - self.t
                self.t = end
                if end == self.busy.end:
                    done, self.busy = self.busy.on_done, None
                    done()
            elif not self.members:
                self.seconds["waiting"] += until - self.t
                self.t = until
            elif self._checkpoint_due():
                self.begin("checkpoint", self.costs.checkpoint_s(self.model), self._saved)
            elif self.steps_to_own_boundary() == 0:
                self.at_own_boundary()
            else:
                self._train(until)

    def _checkpoint_due(self) -> bool:
        return self.step % self.checkpoint_every == 0 and self.step > self.saved_step

    def _train(self, until: float) -> None:
        step_s = self.step_seconds()
        n = self.checkpoint_every - self.step % self.checkpoint_every
        own = self.steps_to_own_boundary()
        if own is not None:
            n = min(n, own)
        boundary = self.t + n * step_s - self.partial
        end = min(boundary, until)
        elapsed = end - self.t
        if end == boundary:
            done, self.partial = n, 0.0
        else:
            # Rounding must never complete the boundary step early.
            done = min(int((self.partial + elapsed) // step_s), n - 1)
            self.partial = self.partial + elapsed - done * step_s
        self.seconds["compute"] += elapsed
        self.unsaved_compute += elapsed
        self.t = end
        if done:
            self.step += done
            self.samples += done * self.world * self.model.batch_per_gpu
            self.curve.append((self.t, self.samples))

    def begin(self, category: str, seconds: float, on_done: Callable[[], None]) -> None:
        self.busy = _Busy(category, self.t + seconds, on_done)

    def _saved(self) -> None:
        self.saved_step, self.saved_samples = self.step, self.samples
        self.unsaved_compute = 0.0
        self.counts["checkpoints"] += 1
        self.after_checkpoint()

    def interrupt(self) -> None:
        """A failure: the step in flight is redone, and whatever was busy is abandoned."""
        self._to_lost(self.partial)
        self.unsaved_compute -= self.partial
        self.partial = 0.0
        self.busy = None

    def rollback(self) -> None:
        """Back to the last checkpoint: every step since it must be trained again."""
        self.interrupt()
        self._to_lost(self.unsaved_compute)
        self.unsaved_compute = 0.0
        if self.step != self.saved_step:
            self.step, self.samples = self.saved_step, self.saved_samples
            self.curve.append((self.t, self.samples))

    def _to_lost(self, seconds: float) -> None:
        self.seconds["compute"] -= seconds
        self.seconds["lost"] += seconds
