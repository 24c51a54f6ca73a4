"""The channel between the coordinator and its workers: plans, step commits and reports.

It lives in a c10d ``Store`` owned by the coordinator, a process that outlives workers (the
parent in local mode), so a dead worker never takes the channel with it.

A step is committed by the coordinator, not by the workers. Each worker computes its
gradients, says ``prepared``, and applies the optimizer step only once the coordinator has
written the commit. The coordinator commits step s of generation g only when every rank of
g prepared it, and never after it published a newer generation. So either every survivor
applies step s or none does, and no optimizer step is ever applied twice or half-way.

The coordinator can die too. Its store is then gone: every channel call raises
``CoordinatorLost``, the workers keep what they hold in memory, reconnect to its
replacement and say hello again with what they hold (``Hello``). The replacement decides
from those reports alone, so it needs no memory of its predecessor's store. Apart from the
training loop, each worker beats (``Beat``) from a thread of its own, and a survivor whose
collective failed says so (``peer_failed``): that is how the coordinator finds a worker that
vanished or hangs without waiting for Kubernetes (``lazarus_core.liveness``). A node's agent
says at once when one of its rank processes exits (``rank_exited``).

A worker is one rank process, named by its node and GPU (``lazarus_core.plan.member_name``):
hellos, heartbeats and exits are keyed by that name, and so are the directive's transfers.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch.distributed as dist
from lazarus_core.handover import Handover
from lazarus_core.liveness import Beat
from lazarus_core.plan import Plan, Transfer

_PREFIX = "lazarus/"


class ChannelTimeout(RuntimeError):
    """The coordinator did not answer within the bound."""


class CoordinatorLost(Exception):
    """The coordinator's store stopped answering: it died, or its pod is being replaced.

    Not a RuntimeError on purpose: the worker's handlers for failed collectives (which are
    RuntimeErrors) must never mistake it for a peer's failure."""


@dataclass(frozen=True)
class Hello:
    """What a worker holds when it (re)joins: a replacement coordinator decides from this."""
    # A new one per process, so a worker that came back on the same node is told apart.
    incarnation: str
    committed: int = 0  # the last step it applied
    # A step it computed whose commit it never saw (the coordinator died in between): it
    # can apply it if its peers did.
    prepared: int | None = None
    # The experts it holds per layer; None: no state at all (a fresh process).
    holdings: tuple[tuple[int, ...], ...] | None = None
    # Its process id, for the local backend's fault injection (a rank's agent is its parent).
    pid: int | None = None


@dataclass(frozen=True)
class Directive:
    """What the workers of one plan generation do before training on it."""

    plan: Plan
    # First step to run. Survivors redo an interrupted step: it was never committed.
    start_step: int
    transfers: tuple[Transfer, ...] = ()
    # Workers out of the plan that still send expert state (a node under a spot notice):
    # ranked after the plan's.
    draining: tuple[str, ...] = ()
    # Set when some expert lost every replica: load the checkpoint of this step (0: none,
    # start again from the initial weights).
    restore_step: int | None = None
    # Plan workers that hold no state yet, and the survivor that sends them the dense state.
    joiners: tuple[str, ...] = ()
    dense_source: str | None = None
    # Set by a replacement coordinator when the one before it committed this step and died
    # before every worker saw the commit: whoever still holds it prepared applies it first.
    roll_forward: int | None = None

    @classmethod
    def of(cls, plan: Plan, handover: Handover) -> "Directive":
        return cls(plan, start_step=handover.start_step, transfers=handover.transfers,
                   draining=handover.draining, restore_step=handover.restore_step,
                   joiners=handover.joiners, dense_source=handover.dense_source,
                   roll_forward=handover.roll_forward)

    @property
    def generation(self) -> int:
        return self.plan.generation

    def exchange_ranks(self) -> dict[str, int]:
        """Ranks in the generation's exchange group, by worker: the plan's, then the
        draining workers'."""
        ranks = self.plan.members()
        for i, name in enumerate(self.draining):
            ranks[name] = self.plan.world_size + i
        return ranks

    def to_json(self) -> str:
        return json.dumps({
            "plan": self.plan.to_dict(),
            "start_step": self.start_step,
            "transfers": [asdict(t) for t in self.transfers],
            "draining": list(self.draining),
            "restore_step": self.restore_step,
            "joiners": list(self.joiners),
            "dense_source": self.dense_source,
            "roll_forward": self.roll_forward,
        })

    @classmethod
    def from_json(cls, text: str) -> "Directive":
        d = json.loads(text)
        return cls(plan=Plan.from_dict(d["plan"]), start_step=d["start_step"],
                   transfers=tuple(Transfer(**t) for t in d["transfers"]),
                   draining=tuple(d["draining"]), restore_step=d["restore_step"],
                   joiners=tuple(d["joiners"]), dense_source=d["dense_source"],
                   roll_forward=d["roll_forward"])


@dataclass(frozen=True)
class StepReport:
    """One rank's account of a prepared step."""

    loss: float
    sample_ids: tuple[int, ...]
    # (layers, experts) global token counts of this step: rank 0 only.
    loads: tuple[tuple[int, ...], ...] | None = None
    timings: dict[str, float] = field(default_factory=dict)


class JobChannel:
    def __init__(self, store: dist.Store, poll_s: float = 0.002,
                 on_poll: Callable[[], None] = lambda: None):
        self.store = store
        self.poll_s = poll_s
        # Called at every turn of a wait: the worker's training loop is alive while it waits.
        self.on_poll = on_poll

    # --- keys ----------------------------------------------------------------------------
    # Every store access goes through these four, so a dead coordinator surfaces as one
    # exception, whatever the call.

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except (RuntimeError, OSError) as e:  # DistStoreError is a RuntimeError
            raise CoordinatorLost(f"the coordinator's store stopped answering ({e})") from e

    def _has(self, key: str) -> bool:
        return self._call(self.store.check, [_PREFIX + key])

    def _get(self, key: str) -> str:
        return self._call(self.store.get, _PREFIX + key).decode()

    def _set(self, key: str, value: str) -> None:
        self._call(self.store.set, _PREFIX + key, value)

    def _add(self, key: str, amount: int) -> int:
        return self._call(self.store.add, _PREFIX + key, amount)

    # --- plans ---------------------------------------------------------------------------

    def publish(self, directive: Directive, switch: bool = True) -> None:
        """The directive first, then the pointer to it: a reader never sees half of it.

        ``switch=False`` stores it without pointing the workers at it yet: a boundary
        reconfiguration is announced through the step commit, and only then switched to
        (``switch_to``), so the commit is never mistaken for an abandoned step."""
        self._set(f"directive/{directive.generation}", directive.to_json())
        if switch:
            self.switch_to(directive.generation)

    def switch_to(self, generation: int) -> None:
        self._set("latest", str(generation))

    def latest(self) -> int:
        return int(self._get("latest")) if self._has("latest") else 0

    def directive(self, generation: int) -> Directive:
        return Directive.from_json(self._get(f"directive/{generation}"))

    def stop(self) -> None:
        self._set("stop", "1")

    def stopped(self) -> bool:
        return self._has("stop")

    # --- steps ---------------------------------------------------------------------------

    def prepare(self, generation: int, step: int, rank: int, report: StepReport) -> None:
        self._set(f"report/{generation}/{step}/{rank}", json.dumps(asdict(report)))
        self._add(f"prepared/{generation}/{step}", 1)

    def prepared(self, generation: int, step: int) -> int:
        return self._add(f"prepared/{generation}/{step}", 0)

    def reports(self, generation: int, step: int, world_size: int) -> list[StepReport]:
        out = []
        for rank in range(world_size):
            d = json.loads(self._get(f"report/{generation}/{step}/{rank}"))
            d["sample_ids"] = tuple(d["sample_ids"])
            d["loads"] = tuple(map(tuple, d["loads"])) if d["loads"] is not None else None
            out.append(StepReport(**d))
        return out

    def commit(self, generation: int, step: int, next_generation: int) -> None:
        """Let generation ``generation`` apply ``step``; the workers continue in
        ``next_generation`` (a boundary reconfiguration when it is newer)."""
        self._set(f"commit/{generation}/{step}", str(next_generation))

    def wait_commit(self, generation: int, step: int, timeout_s: float) -> int | None:
        """The generation to continue in once ``step`` is committed, or None when a newer
        generation was published without committing it (the step is abandoned)."""
        key = f"commit/{generation}/{step}"
        deadline = time.monotonic() + timeout_s
        while True:
            self.on_poll()
            if self._has(key):
                return int(self._get(key))
            if self.latest() > generation:
                # The commit is always written before a newer plan, so look once more.
                return int(self._get(key)) if self._has(key) else None
            if time.monotonic() > deadline:
                raise ChannelTimeout(f"step {step} was neither committed nor superseded "
                                     f"within {timeout_s:.0f} s")
            time.sleep(self.poll_s)

    # --- adopting a generation -------------------------------------------------------------
    # Like steps, a new layout is applied by all members or none: each member fetches what
    # it needs, says so, and switches only once the coordinator confirms that every member
    # has. An interrupted reconfiguration thus leaves every survivor on the last adopted
    # plan, which is what the coordinator plans the next transfers from.

    def fetched(self, generation: int) -> None:
        self._add(f"fetched/{generation}", 1)

    def fetched_count(self, generation: int) -> int:
        return self._add(f"fetched/{generation}", 0)

    def adopt(self, generation: int) -> None:
        self._set(f"adopted/{generation}", "1")

    def wait_adopted(self, generation: int, timeout_s: float) -> bool:
        """True once ``generation`` is adopted; False if a newer one came first."""
        key = f"adopted/{generation}"
        ok = self.wait_until(lambda: self._has(key), timeout_s,
                             f"adoption of generation {generation}",
                             interrupted=lambda: self.latest() > generation)
        return ok or self._has(key)

    # --- membership, liveness and checkpoints ---------------------------------------------

    def hello(self, node: str, hello: Hello) -> None:
        # A process that says hello is alive, whatever an agent said of a predecessor of
        # the same name (a pod replaced on the same node).
        self._call(self.store.delete_key, f"{_PREFIX}exited/{node}")
        self._set(f"hello/{node}", json.dumps(asdict(hello)))

    def said_hello(self, node: str) -> bool:
        return self._has(f"hello/{node}")

    def hello_of(self, node: str) -> Hello | None:
        if not self.said_hello(node):
            return None
        d = json.loads(self._get(f"hello/{node}"))
        holdings = d["holdings"]
        return Hello(d["incarnation"], d["committed"], d["prepared"],
                     tuple(map(tuple, holdings)) if holdings is not None else None,
                     d.get("pid"))

    def rank_exited(self, worker: str, status: int) -> None:
        """A node agent saw its rank process ``worker`` exit with ``status``."""
        self._set(f"exited/{worker}", str(status))

    def exits(self, workers: list[str]) -> dict[str, int]:
        """The exit status of each of ``workers`` whose agent reported it gone."""
        keys = [f"exited/{w}" for w in workers]
        present = [k for k in keys if self._has(k)]
        values = (self._call(self.store.multi_get, [_PREFIX + k for k in present])
                  if present else [])
        return {k.removeprefix("exited/"): int(v.decode()) for k, v in zip(present, values)}

    def beat(self, node: str, beat: Beat) -> None:
        self._set(f"beat/{node}", json.dumps(asdict(beat)))

    def beats(self, nodes: list[str]) -> dict[str, Beat]:
        """The latest heartbeat of each of ``nodes`` that has one."""
        if not nodes:
            return {}
        keys = [f"beat/{n}" for n in nodes]
        present = [k for k in keys if self._has(k)]
        values = (self._call(self.store.multi_get, [_PREFIX + k for k in present])
                  if present else [])
        return {k.removeprefix("beat/"): Beat(**json.loads(v.decode()))
                for k, v in zip(present, values)}

    def peer_failed(self, generation: int) -> None:
        """A collective of ``generation`` failed because a peer went away."""
        self._add(f"failed/{generation}", 1)

    def failures(self, generation: int) -> int:
        return self._add(f"failed/{generation}", 0)

    def report_timings(self, generation: int, rank: int, timings: dict[str, float]) -> None:
        self._set(f"timings/{generation}/{rank}", json.dumps(timings))

    def timings(self, generation: int, rank: int) -> dict[str, float] | None:
        key = f"timings/{generation}/{rank}"
        return json.loads(self._get(key)) if self._has(key) else None

    def checkpoint_written(self, generation: int, step: int, rank: int, info: dict) -> int:
        self._set(f"ckpt/{generation}/{step}/{rank}", json.dumps(info))
        return self._add(f"ckpt/{generation}/{step}", 1)

    def checkpoint_shards(self, generation: int, step: int, world_size: int) -> list[dict]:
        return [json.loads(self._get(f"ckpt/{generation}/{step}/{r}")) for r in range(world_size)]

    def checkpoint_count(self, generation: int, step: int) -> int:
        return self._add(f"ckpt/{generation}/{step}", 0)

    def report_checkpoint(self, step: int, error: str | None) -> None:
        """How the checkpoint of ``step`` went (rank 0, for all ranks): ``error`` says why
        it was skipped, None that it was written."""
        self._set("checkpoint_health", json.dumps({"step": step, "error": error}))
        if error is not None:
            self._add("checkpoint_failures", 1)

    def checkpoint_health(self) -> tuple[str | None, int]:
        """(why the latest checkpoint was skipped, or None if it was written or none was
        due yet; checkpoints skipped so far)."""
        latest = (json.loads(self._get("checkpoint_health"))["error"]
                  if self._has("checkpoint_health") else None)
        return latest, self._add("checkpoint_failures", 0)

    def set_checkpoint(self, step: int) -> None:
        self._set("checkpoint", str(step))

    def checkpoint(self) -> int | None:
        return int(self._get("checkpoint")) if self._has("checkpoint") else None

    def wait_until(self, ready: Callable[[], bool], timeout_s: float, what: str,
                   interrupted: Callable[[], bool] = lambda: False) -> bool:
        """Poll ``ready``; False if ``interrupted`` first; ChannelTimeout past the bound."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            self.on_poll()
            if interrupted():
                return False
            if time.monotonic() > deadline:
                raise ChannelTimeout(f"{what}: no answer within {timeout_s:.0f} s")
            time.sleep(self.poll_s)
        return True
