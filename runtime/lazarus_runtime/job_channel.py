"""The channel between the coordinator and its workers: plans, step commits and reports.

It lives in a c10d ``Store`` owned by the coordinator, a process that outlives workers (the
parent in local mode), so a dead worker never takes the channel with it. This module is the
one place that names, writes and reads the store's keys.

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

Trust. A c10d store has no authentication: anyone who can reach its port can set, add to,
and delete any key. The job's pods are meant to be the only ones who can (a NetworkPolicy
per job), but the channel does not rely on it. Every value is signed: an HMAC-SHA256 under
the job's key (a random key per job: a Secret only the job's pods mount, or, locally, made
by the parent and handed to its workers) over the job's name, the key's name and the value.
A reader acts only on values that verify, and logs the rest (once per key and value). So
someone who reaches the store without the key can:
- write any key (a stop, a commit, a directive, a report, a hello): the value does not
  verify, is dropped and logged, and the key's owner, which checks its keys every
  ``guard_s``, writes its own value back (meanwhile a reader goes on from the last value it
  verified, as ``latest`` and hellos do, or waits);
- copy a signed value to another key (step 7's commit as step 8's, one rank's report as
  another's): the signature covers the key's name, so it fails like a forgery;
- write back an older signed value of the same key (``latest`` of a past generation, an
  older checkpoint step): readers of those keys only move forward, and the owner rewrites it;
- delete a key: the owner writes it again at its next check;
- bump a counter (prepared, fetched, checkpoint shards, peer failures): counters only tell
  a reader when to look; it acts on the signed records behind them, so a bumped counter
  costs a lookup;
- still deny service: delete keys faster than their owners restore them, write a worker's
  older heartbeat back until the worker looks silent (the coordinator then plans without
  it, and takes it back when it is heard again), fill the store's memory, or disturb the
  process groups' rendezvous keys, which c10d writes unsigned (and
  the collectives' own traffic is not authenticated either: PyTorch assumes a trusted
  network). Keeping strangers away from the store and the workers' ports is the
  NetworkPolicy's job; the signatures make sure that whoever gets through cannot steer the
  job, forge a commit, or crash a reader.

Keys are pruned as the job goes: a step's keys once later steps are committed, a
generation's (its directive, adoption, its process groups' rendezvous keys) once two newer
generations exist, so the store stays the same size however long the job runs.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import torch.distributed as dist
from lazarus_core.handover import Handover
from lazarus_core.liveness import Beat
from lazarus_core.plan import Plan, Transfer
from lazarus_core.process_env import check_job_key

log = logging.getLogger("lazarus.channel")

_PREFIX = "lazarus/"
# The signature (hex HMAC-SHA256) comes first in every value; the payload follows it.
_MAC_CHARS = 64
_CONTEXT = b"lazarus.dev/job-channel/v1"
# How many of the rejected (key, value) pairs are remembered, so each is logged once.
_REJECTED_MEMORY = 1024


def group_store(store: dist.Store, scope: str) -> dist.PrefixStore:
    """The store scope of one process group (``scope``: a generation, or "<g>-exchange")."""
    return dist.PrefixStore(f"{_PREFIX}gen{scope}", store)


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
            "transfers": [t._asdict() for t in self.transfers],
            "draining": list(self.draining),
            "restore_step": self.restore_step,
            "joiners": list(self.joiners),
            "dense_source": self.dense_source,
            "roll_forward": self.roll_forward,
        })

    @classmethod
    def from_dict(cls, d: dict) -> "Directive":
        return cls(plan=Plan.from_dict(d["plan"]), start_step=d["start_step"],
                   transfers=tuple(Transfer(**t) for t in d["transfers"]),
                   draining=tuple(d["draining"]), restore_step=d["restore_step"],
                   joiners=tuple(d["joiners"]), dense_source=d["dense_source"],
                   roll_forward=d["roll_forward"])


@dataclass(frozen=True)
class RankExit:
    """A rank process its node agent saw exit: the status (negative: a signal), the last
    line it wrote to stderr (usually the error that ended it), and the agent's pod (its
    uid; empty outside a cluster)."""
    status: int
    last_words: str = ""
    pod: str = ""


@dataclass(frozen=True)
class StepReport:
    """One rank's account of a prepared step."""

    loss: float
    sample_ids: tuple[int, ...]
    # (layers, experts) global token counts of this step: rank 0 only.
    loads: tuple[tuple[int, ...], ...] | None = None
    timings: dict[str, float] = field(default_factory=dict)


class JobChannel:
    """Signed reads and writes of the channel's keys (see the module docstring).

    ``key`` is the job's key as text (``process_env.new_job_key``: the form the job's
    Secret and its pods' environment hold); ``job`` is the job's name, also signed."""

    def __init__(self, store: dist.Store, key: str, job: str, poll_s: float = 0.002,
                 guard_s: float = 0.5, on_poll: Callable[[], None] = lambda: None):
        check_job_key(key)
        self.store = store
        self.poll_s = poll_s
        self.guard_s = guard_s
        # Called at every turn of a wait: the worker's training loop is alive while it waits.
        self.on_poll = on_poll
        self._key = key.encode()
        self._job = job.encode()
        self._absent = b"\0absent:" + secrets.token_hex(16).encode()
        # Keys this side wrote and keeps alive: name -> (signed value, the number it says,
        # for keys whose readers only move forward).
        self._owned: dict[str, tuple[bytes, int | None]] = {}
        self._guarded_at = time.monotonic()
        self._rejected: set[tuple[str, bytes]] = set()
        self.rejected = 0  # values dropped because they did not verify
        self._latest = 0
        self._checkpoint: int | None = None
        self._hellos: dict[str, Hello] = {}  # node -> its newest signed hello, one per node
        self._stopped = False

    # --- signed keys -----------------------------------------------------------------------
    # Every store access goes through ``_call``, so a dead coordinator surfaces as one
    # exception, whatever the call.

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except (RuntimeError, OSError) as e:  # DistStoreError is a RuntimeError
            raise CoordinatorLost(f"the coordinator's store stopped answering ({e})") from e

    def _mac(self, name: str, payload: bytes) -> bytes:
        message = b"\0".join((_CONTEXT, self._job, name.encode(), payload))
        return hmac.new(self._key, message, hashlib.sha256).hexdigest().encode()

    def _set(self, name: str, value: str, own: bool = True, forward: int | None = None) -> None:
        payload = value.encode()
        signed = self._mac(name, payload) + payload
        self._call(self.store.set, _PREFIX + name, signed)
        if own:
            self._owned[name] = (signed, forward)

    def _raw(self, name: str) -> bytes | None:
        """The stored bytes, or None if absent, in one round trip that never waits: a
        compare-and-set whose expected and new values are this channel's secret sentinel
        changes nothing and answers the stored value, or the sentinel if there is none."""
        value = self._call(self.store.compare_set, _PREFIX + name, self._absent,
                           self._absent)
        return None if value == self._absent else value

    def _get(self, name: str) -> str | None:
        """The verified value of ``name``, or None if absent or not signed by the job."""
        raw = self._raw(name)
        return None if raw is None else self._verify(name, raw)

    def _verify(self, name: str, raw: bytes) -> str | None:
        mac, payload = raw[:_MAC_CHARS], raw[_MAC_CHARS:]
        if hmac.compare_digest(mac, self._mac(name, payload)):
            try:
                return payload.decode()
            except UnicodeDecodeError:
                pass  # signed by the job, yet not text: a bug, dropped all the same
        self.rejected += 1
        seen = (name, hashlib.sha256(raw).digest())
        if seen not in self._rejected:
            if len(self._rejected) >= _REJECTED_MEMORY:
                self._rejected.clear()
            self._rejected.add(seen)
            log.warning("dropped a value of %s%s that is not signed with the job's key "
                        "(%d bytes)", _PREFIX, name, len(raw))
        return None

    def _json(self, name: str):
        """The verified value of ``name`` as JSON, or None (a genuine but unreadable value
        is a bug elsewhere; it is logged and dropped rather than crashing the reader)."""
        text = self._get(name)
        if text is None:
            return None
        try:
            return json.loads(text)
        except ValueError:
            log.error("dropped an unreadable value of %s%s", _PREFIX, name)
            return None

    def _hint(self, name: str, amount: int) -> int:
        """A counter: when to look, never what to believe."""
        return self._call(self.store.add, _PREFIX + name, amount)

    def _forget(self, names: Iterable[str]) -> None:
        """Delete keys this side no longer needs (and stop keeping them alive)."""
        for name in names:
            self._owned.pop(name, None)
            self._call(self.store.delete_key, _PREFIX + name)

    def _disown(self, prefix: str) -> None:
        for name in [n for n in self._owned if n.startswith(prefix)]:
            del self._owned[name]

    def _settled(self, outcome):
        """A worker's step is decided (committed or abandoned): the coordinator has read its
        report, the last checkpoint shard and the generation's timings, and now prunes
        them; they are no longer this side's to keep."""
        for prefix in ("report/", "ckpt/", "timings/"):
            self._disown(prefix)
        return outcome

    def guard(self, force: bool = False) -> int:
        """Write back the keys this side owns that someone deleted or overwrote, at most
        every ``guard_s``; the number rewritten. Waits call it, so an owner that waits for
        its readers is also the one that keeps what they read intact."""
        now = time.monotonic()
        if not force and now - self._guarded_at < self.guard_s:
            return 0
        self._guarded_at = now
        rewritten = 0
        for name, (signed, forward) in list(self._owned.items()):
            current = self._raw(name)
            if current == signed:
                continue
            if forward is not None and current is not None:
                value = self._verify(name, current)
                if value is not None and value.isdigit() and int(value) >= forward:
                    del self._owned[name]  # legitimately moved on by its next writer
                    continue
            log.warning("%s%s was %s; writing it back", _PREFIX, name,
                        "deleted" if current is None else "overwritten")
            self._call(self.store.set, _PREFIX + name, signed)
            rewritten += 1
        return rewritten

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
        self._set("latest", str(generation), forward=generation)

    def latest(self) -> int:
        """The newest generation published; it never goes back (an older signed value
        written back by someone else is ignored)."""
        value = self._get("latest")
        if value is not None and value.isdigit():
            self._latest = max(self._latest, int(value))
        return self._latest

    def directive(self, generation: int) -> Directive | None:
        """The directive of ``generation``, or None if it is not (or no longer) there."""
        doc = self._json(f"directive/{generation}")
        if doc is None:
            return None
        try:
            return Directive.from_dict(doc)
        except (KeyError, TypeError, ValueError) as e:
            log.error("dropped an unreadable directive of generation %d: %s", generation, e)
            return None

    def wait_directive(self, generation: int, timeout_s: float) -> Directive | None:
        """The directive of ``generation`` once it reads (its writer restores a deleted one
        within ``guard_s``), or None if a newer generation came first."""
        found: list[Directive] = []

        def ready() -> bool:
            d = self.directive(generation)
            if d is not None:
                found.append(d)
            return d is not None

        self.wait_until(ready, timeout_s, f"the directive of generation {generation}",
                        interrupted=lambda: self.latest() > generation)
        return found[0] if found else None

    def stop(self) -> None:
        self._set("stop", "1")

    def stopped(self) -> bool:
        self._stopped = self._stopped or self._get("stop") == "1"
        return self._stopped

    # --- steps ---------------------------------------------------------------------------

    def prepare(self, generation: int, step: int, rank: int, report: StepReport) -> None:
        self._disown("report/")  # a rank has one step in flight: the last is committed
        self._set(f"report/{generation}/{step}/{rank}", json.dumps(asdict(report)))
        self._hint(f"prepared/{generation}/{step}", 1)

    def reports(self, generation: int, step: int, world_size: int) -> list[StepReport] | None:
        """Every rank's signed report of ``step``, or None while any is missing or forged
        (the counter of prepared ranks says when to look, the reports decide)."""
        if self._hint(f"prepared/{generation}/{step}", 0) < world_size:
            return None
        names = [f"report/{generation}/{step}/{rank}" for rank in range(world_size)]
        keys = [_PREFIX + n for n in names]
        try:
            if not self.store.check(keys):
                return None
            # One round trip for them all; a report deleted since the check makes it wait
            # for the store's timeout, and then count as missing.
            raw = self.store.multi_get(keys)
        except RuntimeError:
            return None
        out = []
        for name, value in zip(names, raw):
            text = self._verify(name, value)
            if text is None:
                return None
            try:
                d = json.loads(text)
                out.append(StepReport(
                    loss=float(d["loss"]), sample_ids=tuple(int(i) for i in d["sample_ids"]),
                    loads=(tuple(tuple(int(t) for t in layer) for layer in d["loads"])
                           if d["loads"] is not None else None),
                    timings={str(k): float(v) for k, v in (d.get("timings") or {}).items()}))
            except (KeyError, TypeError, ValueError) as e:
                log.error("dropped an unreadable report %s%s: %s", _PREFIX, name, e)
                return None
        return out

    def commit(self, generation: int, step: int, next_generation: int) -> None:
        """Let generation ``generation`` apply ``step``; the workers continue in
        ``next_generation`` (a boundary reconfiguration when it is newer)."""
        self._set(f"commit/{generation}/{step}", str(next_generation))

    def committed(self, generation: int, step: int) -> int | None:
        """The generation that follows a committed ``step``, or None if it is not committed."""
        value = self._get(f"commit/{generation}/{step}")
        return int(value) if value is not None and value.isdigit() else None

    def wait_commit(self, generation: int, step: int, timeout_s: float) -> int | None:
        """The generation to continue in once ``step`` is committed, or None when a newer
        generation was published without committing it (the step is abandoned)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.on_poll()
            if (committed := self.committed(generation, step)) is not None:
                return self._settled(committed)
            if self.latest() > generation:
                # The commit is always written before a newer plan, so look once more.
                return self._settled(self.committed(generation, step))
            if time.monotonic() > deadline:
                raise ChannelTimeout(f"step {step} was neither committed nor superseded "
                                     f"within {timeout_s:.0f} s")
            self.guard()
            time.sleep(self.poll_s)

    # --- adopting a generation -------------------------------------------------------------
    # Like steps, a new layout is applied by all members or none: each member fetches what
    # it needs, says so, and switches only once the coordinator confirms that every member
    # has. An interrupted reconfiguration thus leaves every survivor on the last adopted
    # plan, which is what the coordinator plans the next transfers from.

    def fetched(self, generation: int, node: str) -> None:
        self._disown("fetched/")
        self._set(f"fetched/{generation}/{node}", "1")
        self._hint(f"fetched/{generation}", 1)

    def all_fetched(self, generation: int, members: Iterable[str]) -> bool:
        """Whether every member of ``generation`` says, signed, that it has its state."""
        members = list(members)
        if self._hint(f"fetched/{generation}", 0) < len(members):
            return False
        return all(self._get(f"fetched/{generation}/{m}") == "1" for m in members)

    def adopt(self, generation: int) -> None:
        self._set(f"adopted/{generation}", "1")

    def wait_adopted(self, generation: int, timeout_s: float) -> bool:
        """True once ``generation`` is adopted; False if a newer one came first."""
        key = f"adopted/{generation}"
        ok = self.wait_until(lambda: self._get(key) == "1", timeout_s,
                             f"adoption of generation {generation}",
                             interrupted=lambda: self.latest() > generation)
        self._disown("fetched/")  # adopted or superseded: read, or no longer wanted
        return ok or self._get(key) == "1"

    # --- membership, liveness and checkpoints ---------------------------------------------

    def hello(self, node: str, hello: Hello) -> None:
        # A process that says hello is alive, whatever an agent said of a predecessor of
        # the same name (a pod replaced on the same node).
        self._call(self.store.delete_key, f"{_PREFIX}exited/{node}")
        self._set(f"hello/{node}", json.dumps(asdict(hello)))

    def said_hello(self, node: str) -> bool:
        return self.hello_of(node) is not None

    def hello_of(self, node: str) -> Hello | None:
        """The newest signed hello of ``node`` this side has read. A hello is never taken
        back (a worker that restarts says a new one), so one that was overwritten or deleted
        since still stands: its owner writes it back, and meanwhile the worker must not look
        gone."""
        d = self._json(f"hello/{node}")
        if d is None:
            return self._hellos.get(node)
        try:
            holdings, prepared, pid = d["holdings"], d["prepared"], d.get("pid")
            hello = Hello(str(d["incarnation"]), int(d["committed"]),
                          int(prepared) if prepared is not None else None,
                          tuple(tuple(int(e) for e in layer) for layer in holdings)
                          if holdings is not None else None,
                          int(pid) if pid is not None else None)
        except (KeyError, TypeError, ValueError) as e:
            log.error("dropped an unreadable hello of %s: %s", node, e)
            return self._hellos.get(node)
        self._hellos[node] = hello
        return hello

    def rank_exited(self, worker: str, how: RankExit) -> None:
        """A node agent saw its rank process ``worker`` exit. Not kept alive by a guard:
        the rank's next hello deletes it, and must not see it written back."""
        self._set(f"exited/{worker}", json.dumps(asdict(how)), own=False)

    def exits(self, workers: list[str]) -> dict[str, RankExit]:
        """How each of ``workers`` whose agent reported it gone exited, signed."""
        out = {}
        for worker in workers:
            value = self._get(f"exited/{worker}")
            if value is None:
                continue
            try:
                d = json.loads(value)
                out[worker] = RankExit(int(d["status"]), str(d["last_words"]), str(d["pod"]))
            except (KeyError, TypeError, ValueError):
                log.error("dropped an unreadable exit report of %s: %r", worker, value)
        return out

    def beat(self, node: str, beat: Beat) -> None:
        # Not kept alive by a guard: the next beat writes it again anyway.
        self._set(f"beat/{node}", json.dumps(asdict(beat)), own=False)

    def beats(self, nodes: list[str]) -> dict[str, Beat]:
        """The latest signed heartbeat of each of ``nodes`` that has one."""
        out = {}
        for node in nodes:
            d = self._json(f"beat/{node}")
            try:
                if d is not None:
                    out[node] = Beat(int(d["count"]), float(d["busy_s"]), bool(d["in_step"]))
            except (KeyError, TypeError, ValueError) as e:
                log.error("dropped an unreadable heartbeat of %s: %s", node, e)
        return out

    def peer_failed(self, generation: int, node: str) -> None:
        """``node`` saw a collective of ``generation`` fail because a peer went away."""
        self._set(f"failed/{generation}/{node}", "1", own=False)
        self._hint(f"failed/{generation}", 1)

    def failures(self, generation: int, members: Iterable[str]) -> int:
        """How many of ``members`` said, signed, that a collective of ``generation`` failed
        (the counter only says whether to look)."""
        if self._hint(f"failed/{generation}", 0) == 0:
            return 0
        return sum(self._get(f"failed/{generation}/{m}") == "1" for m in members)

    def report_timings(self, generation: int, rank: int, timings: dict[str, float]) -> None:
        self._disown("timings/")
        self._set(f"timings/{generation}/{rank}", json.dumps(timings))

    def timings(self, generation: int, rank: int) -> dict[str, float] | None:
        d = self._json(f"timings/{generation}/{rank}")
        try:
            return {str(k): float(v) for k, v in d.items()} if d is not None else None
        except (AttributeError, TypeError, ValueError):
            return None

    def checkpoint_written(self, generation: int, step: int, rank: int, info: dict) -> None:
        self._disown("ckpt/")
        self._set(f"ckpt/{generation}/{step}/{rank}", json.dumps(info))
        self._hint(f"ckpt/{generation}/{step}", 1)

    def checkpoint_shards(self, generation: int, step: int,
                          world_size: int) -> list[dict] | None:
        """Every rank's signed shard record of ``step``, or None while any is missing."""
        if self._hint(f"ckpt/{generation}/{step}", 0) < world_size:
            return None
        shards = [self._json(f"ckpt/{generation}/{step}/{r}") for r in range(world_size)]
        return None if any(not isinstance(s, dict) for s in shards) else shards

    def report_checkpoint(self, step: int, error: str | None) -> None:
        """How the checkpoint of ``step`` went (rank 0, for all ranks): ``error`` says why
        it was skipped, None that it was written. The count of skipped checkpoints rides in
        the same signed value (a counter anyone could bump), carried on from the last one;
        not kept alive by a guard: rank 0 changes across generations, and each checkpoint
        writes it again."""
        _, failures = self.checkpoint_health()
        failures += error is not None
        self._set("checkpoint_health",
                  json.dumps({"step": step, "error": error, "failures": failures}), own=False)

    def checkpoint_health(self) -> tuple[str | None, int]:
        """(why the latest checkpoint was skipped, or None if it was written or none was
        due yet; checkpoints skipped so far)."""
        d = self._json("checkpoint_health")
        try:
            return (None if d is None or d["error"] is None else str(d["error"]),
                    int(d["failures"]) if d is not None else 0)
        except (KeyError, TypeError, ValueError) as e:
            log.error("dropped an unreadable checkpoint report: %s", e)
            return None, 0

    def set_checkpoint(self, step: int) -> None:
        self._set("checkpoint", str(step), forward=step)

    def checkpoint(self) -> int | None:
        """The newest complete checkpoint's step; like ``latest``, it never goes back."""
        value = self._get("checkpoint")
        if value is not None and value.isdigit():
            self._checkpoint = max(self._checkpoint or 0, int(value))
        return self._checkpoint

    # --- pruning (the coordinator, which owns the store) ------------------------------------

    def prune_step(self, generation: int, step: int, world_size: int) -> None:
        """Delete the keys of ``step`` in ``generation``: every rank has moved past them."""
        names = [f"prepared/{generation}/{step}", f"commit/{generation}/{step}",
                 f"ckpt/{generation}/{step}"]
        names += [f"{kind}/{generation}/{step}/{rank}" for kind in ("report", "ckpt")
                  for rank in range(world_size)]
        self._forget(names)

    def prune_generation(self, generation: int, members: Iterable[str], ranks: int) -> None:
        """Delete the keys of a generation two or more behind the newest: its directive,
        adoption and timings, and its process groups' rendezvous keys."""
        members = list(members)
        names = [f"directive/{generation}", f"adopted/{generation}", f"fetched/{generation}",
                 f"failed/{generation}"]
        names += [f"{kind}/{generation}/{m}" for kind in ("fetched", "failed") for m in members]
        names += [f"timings/{generation}/{r}" for r in range(ranks)]
        self._forget(names)
        groups = (f"{_PREFIX}gen{generation}/", f"{_PREFIX}gen{generation}-exchange/")
        for key in self._call(self.store.list_keys):
            if key.startswith(groups):
                self._call(self.store.delete_key, key)

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
            self.guard()
            time.sleep(self.poll_s)
        return True
