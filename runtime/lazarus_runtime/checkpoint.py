"""Checkpoints: one shard per rank, a manifest with checksums, nothing trusted unverified.

Each expert replica set is saved once, by the lowest rank holding it; rank 0 also saves the
dense parameters. A shard's name carries its writer's random id, so a redone step, a stale
writer or another run never overwrites a file some manifest lists. The manifest, written
last by rank 0 once every shard is stored, lists each shard's size and SHA-256 and carries
a checksum of its own. A checkpoint counts as complete only when its manifest verifies and
every shard is there at its listed size; loading one also checks each shard's SHA-256.
So a crash while writing, a truncated upload or a flipped byte leaves the previous complete
checkpoint in charge, never a half-written one.

Storage faults must not stop training: a write is retried with backoff, then given up with
``CheckpointWriteFailed``, which the worker reports and survives. After each manifest the
checkpoints beyond the newest ``keep`` complete ones are deleted.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from lazarus_core.checkpoint_location import KEEP_DEFAULT
from lazarus_core.plan import ExpertKey, Plan

from .storage import Storage, open_storage

log = logging.getLogger("lazarus.checkpoint")

FORMAT = 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted: a missing shard, a bad checksum."""


class CheckpointWriteFailed(RuntimeError):
    """A write that still failed after every retry; the checkpoint is skipped."""


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


def owned_experts(plan: Plan, rank: int) -> list[ExpertKey]:
    """The experts ``rank`` saves under ``plan``: those it is the lowest-ranked holder of, so
    every expert is written exactly once."""
    owners: dict[ExpertKey, int] = {}
    for layer in range(len(plan.layers)):
        for r in range(plan.world_size):  # ascending: the first holder seen is the lowest
            for e in plan.rank_experts(layer, r):
                owners.setdefault((layer, e), r)
    return [key for key, owner in owners.items() if owner == rank]


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a failed write is tried again before it is skipped. The
    default gives up within about 1.5 s of waiting, so training stalls little."""

    attempts: int = 3
    first_delay_s: float = 0.5
    factor: float = 2.0

    def delays(self) -> list[float]:
        """The waits between consecutive attempts."""
        return [self.first_delay_s * self.factor ** i for i in range(self.attempts - 1)]


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _manifest_body(step: int, shards: list[dict]) -> bytes:
    return json.dumps({"format": FORMAT, "step": step, "shards": shards},
                      sort_keys=True).encode()


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint: its manifest verified, every shard present at its size."""

    step: int
    storage: Storage
    shards: tuple[dict, ...]

    def _fetch(self, shard: dict) -> bytes:
        """A shard's bytes, checked against the manifest's checksum."""
        path = f"{step_dir(self.step)}/{shard['file']}"
        try:
            data = self.storage.get(path)
        except FileNotFoundError:
            raise CheckpointError(f"{self.storage.path(path)}: shard missing") from None
        if _digest(data) != shard["sha256"]:
            raise CheckpointError(f"{self.storage.path(path)}: checksum mismatch, the file "
                                  f"is corrupt")
        return data

    def load(self, experts: set[ExpertKey]) -> tuple[dict, dict[ExpertKey, dict]]:
        """(dense state, states of the requested experts), every shard read verified."""
        dense, found = None, {}
        for shard in self.shards:
            keys = {tuple(k) for k in shard["experts"]}
            if not shard["dense"] and not (keys & experts):
                continue
            payload = torch.load(io.BytesIO(self._fetch(shard)), weights_only=True)
            if shard["dense"]:
                dense = payload["dense"]
            for key in keys & experts:
                found[key] = payload["experts"][f"{key[0]}.{key[1]}"]
        missing = experts - set(found)
        if missing or dense is None:
            raise CheckpointError(f"step {self.step}: no state for "
                                  f"{sorted(missing) or 'the dense parameters'}")
        return dense, found

    def verify(self) -> None:
        """Read every shard and check its checksum; CheckpointError if one fails."""
        for shard in self.shards:
            self._fetch(shard)


class Checkpoints:
    """The checkpoints of one job in its storage."""

    def __init__(self, storage: Storage, keep: int = KEEP_DEFAULT,
                 retry: RetryPolicy = RetryPolicy()):
        self.storage = storage
        self.keep = keep
        self.retry = retry

    @classmethod
    def open(cls, location: str, job_uid: str | None, keep: int = KEEP_DEFAULT,
             retry: RetryPolicy = RetryPolicy()) -> "Checkpoints":
        return cls(open_storage(location, job_uid), keep, retry)

    # --- writing -------------------------------------------------------------------------

    def write_shard(self, step: int, rank: int, experts: dict[ExpertKey, dict],
                    dense: dict | None,
                    interrupted: Callable[[], bool] = lambda: False) -> dict:
        """Save this rank's share; returns its manifest entry. CheckpointWriteFailed once
        every attempt failed (or ``interrupted`` said to stop trying)."""
        buffer = io.BytesIO()
        torch.save({"experts": {f"{l}.{e}": s for (l, e), s in experts.items()},
                    "dense": dense}, buffer)
        data = buffer.getvalue()
        name = f"shard-{rank:05d}-{self.storage.writer}.pt"
        self._put(f"{step_dir(step)}/{name}", data, f"shard of rank {rank}, step {step}",
                  interrupted)
        return {"file": name, "bytes": len(data), "sha256": _digest(data),
                "experts": [list(k) for k in experts], "dense": dense is not None}

    def write_manifest(self, step: int, shards: list[dict],
                       interrupted: Callable[[], bool] = lambda: False) -> None:
        """Make step ``step`` a complete checkpoint (its shards stored already), then delete
        the checkpoints beyond the newest ``keep``."""
        body = _manifest_body(step, shards)
        manifest = json.dumps({"sha256": _digest(body), "body": json.loads(body)},
                              indent=1, sort_keys=True).encode()
        self._put(f"{step_dir(step)}/{MANIFEST}", manifest, f"manifest of step {step}",
                  interrupted)
        try:
            self.prune()
        except OSError as e:  # the next checkpoint prunes again
            log.warning("deleting old checkpoints failed: %s", e)

    def _put(self, path: str, data: bytes, what: str, interrupted: Callable[[], bool]) -> None:
        errors = []
        for delay in [*self.retry.delays(), None]:
            try:
                self.storage.put(path, data)
                return
            except Exception as e:  # noqa: BLE001 - whatever the store says, training goes on
                errors.append(f"{type(e).__name__}: {e}".splitlines()[0][:300])
                if delay is None or interrupted():
                    break
                log.warning("writing the %s failed (%s); again in %.1f s", what, errors[-1],
                            delay)
                time.sleep(delay)
        raise CheckpointWriteFailed(
            f"writing the {what} to {self.storage.path(path)} failed {len(errors)} "
            f"time(s); last error: {errors[-1]}")

    def prune(self) -> list[int]:
        """Delete every checkpoint older than the newest ``keep`` complete ones (partial
        ones too); returns the steps deleted. Newer partial ones may still be in writing,
        so they stay."""
        kept = self.complete()[:self.keep]
        if len(kept) < self.keep:
            return []
        oldest = kept[-1].step
        gone = [s for s in self._steps() if s < oldest]
        for step in gone:
            self.storage.remove(step_dir(step))
        return gone

    # --- reading -------------------------------------------------------------------------

    def _steps(self) -> list[int]:
        """Steps with a folder, newest first."""
        return sorted((int(m[1]) for name in self.storage.listing()
                       if (m := _STEP_DIR.match(name))), reverse=True)

    def _complete(self, step: int) -> Checkpoint:
        """The checkpoint of ``step`` if it is complete; CheckpointError saying why not."""
        directory = step_dir(step)
        files = self.storage.listing(directory)
        if MANIFEST not in files:
            raise CheckpointError(f"step {step}: no manifest, the checkpoint was never finished")
        try:
            manifest = json.loads(self.storage.get(f"{directory}/{MANIFEST}"))
            body = manifest["body"]
            if _digest(_manifest_body(body["step"], body["shards"])) != manifest["sha256"]:
                raise ValueError("checksum mismatch")
            if body["format"] != FORMAT or body["step"] != step:
                raise ValueError(f"format {body['format']}, step {body['step']}")
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"step {step}: the manifest is corrupt ({e})") from None
        for shard in body["shards"]:
            if files.get(shard["file"]) != shard["bytes"]:
                raise CheckpointError(
                    f"step {step}: {shard['file']} is "
                    + ("missing" if shard["file"] not in files else
                       f"{files[shard['file']]} bytes, the manifest says {shard['bytes']}"))
        return Checkpoint(step, self.storage, tuple(body["shards"]))

    def _scan(self, at_most: int | None) -> Iterator[Checkpoint]:
        """The complete checkpoints (no later than ``at_most``), newest first."""
        for step in self._steps():
            if at_most is not None and step > at_most:
                continue
            try:
                yield self._complete(step)
            except CheckpointError as e:
                log.info("skipping %s", e)

    def complete(self, at_most: int | None = None) -> list[Checkpoint]:
        """Every complete checkpoint (no later than ``at_most``), newest first."""
        return list(self._scan(at_most))

    def at(self, step: int) -> Checkpoint:
        """The complete checkpoint of ``step``; CheckpointError when there is none."""
        return self._complete(step)

    def latest(self, at_most: int | None = None) -> Checkpoint | None:
        """The newest complete checkpoint (no later than ``at_most``), its shards unread."""
        return next(self._scan(at_most), None)

    def newest_intact(self, at_most: int | None = None) -> tuple[Checkpoint | None, list[str]]:
        """The newest checkpoint whose every shard reads back with its checksum, and why
        each newer one was skipped. Reads whole checkpoints: for deciding a restore."""
        skipped = []
        for step in self._steps():
            if at_most is not None and step > at_most:
                continue
            try:
                ck = self._complete(step)
                ck.verify()
                return ck, skipped
            except CheckpointError as e:
                skipped.append(str(e))
        return None, skipped
