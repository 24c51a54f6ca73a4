"""Checkpoints: one shard per rank, a manifest with checksums, nothing visible half-written.

Each expert replica set is saved once, by the lowest rank holding it; rank 0 also saves the
dense parameters. Tensors are saved from wherever they live (torch.save copies a GPU's to
the file) and loaded onto the device of the rank that restores them. Shards and the manifest are written to a temporary name and renamed, and
the manifest (written last, by rank 0, once every shard is on disk) lists each shard's
SHA-256. A checkpoint counts only if its manifest exists and every checksum matches, so a
crash during writing leaves the previous checkpoint in charge.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from lazarus_core.plan import ExpertKey, Plan

class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted: missing shard, bad checksum."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def owned_experts(plan: Plan, rank: int) -> list[ExpertKey]:
    """The experts ``rank`` saves under ``plan``: those it is the lowest-ranked holder of, so
    every expert is written exactly once."""
    owners: dict[ExpertKey, int] = {}
    for layer in range(len(plan.layers)):
        for r in range(plan.world_size):  # ascending: the first holder seen is the lowest
            for e in plan.rank_experts(layer, r):
                owners.setdefault((layer, e), r)
    return [key for key, owner in owners.items() if owner == rank]


def write_shard(root: Path, step: int, rank: int, experts: dict[ExpertKey, dict],
                dense: dict | None) -> dict:
    """Save this rank's share; returns the manifest entry for it."""
    directory = step_dir(root, step)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"shard-{rank:05d}.pt"
    payload = {"experts": {f"{l}.{e}": s for (l, e), s in experts.items()}, "dense": dense}
    _atomic_write(path, lambda f: torch.save(payload, f))
    return {"file": path.name, "sha256": _sha256(path),
            "experts": [list(k) for k in experts], "dense": dense is not None}


def write_manifest(root: Path, step: int, shards: list[dict]) -> None:
    manifest = {"step": step, "shards": shards}
    _atomic_write(step_dir(root, step) / "manifest.json",
                  lambda f: f.write(json.dumps(manifest, indent=1).encode()))


@dataclass(frozen=True)
class Checkpoint:
    step: int
    directory: Path
    shards: tuple[dict, ...]

    def _load(self, shard: dict, device: torch.device | str) -> dict:
        path = self.directory / shard["file"]
        if not path.exists():
            raise CheckpointError(f"{path}: shard missing")
        if _sha256(path) != shard["sha256"]:
            raise CheckpointError(f"{path}: checksum mismatch, the file is corrupt")
        # Straight onto the loading rank's device, wherever the saving rank's tensors were.
        return torch.load(path, weights_only=True, map_location=torch.device(device))

    def load(self, experts: set[ExpertKey], device: torch.device | str = "cpu"
             ) -> tuple[dict | None, dict[ExpertKey, dict]]:
        """(dense state, states of the requested experts) on ``device``, checksums verified."""
        dense, found = None, {}
        for shard in self.shards:
            keys = {tuple(k) for k in shard["experts"]}
            if not shard["dense"] and not (keys & experts):
                continue
            payload = self._load(shard, device)
            if shard["dense"]:
                dense = payload["dense"]
            for key in keys & experts:
                found[key] = payload["experts"][f"{key[0]}.{key[1]}"]
        missing = experts - set(found)
        if missing or dense is None:
            raise CheckpointError(f"step {self.step}: no state for "
                                  f"{sorted(missing) or 'the dense parameters'}")
        return dense, found


def latest(root: Path, at_most: int | None = None) -> Checkpoint | None:
    """The newest complete checkpoint (optionally no later than ``at_most``)."""
    root = Path(root)
    if not root.is_dir():
        return None
    for directory in sorted(root.glob("step-*"), reverse=True):
        manifest = directory / "manifest.json"
        if not manifest.exists():
            continue
        m = json.loads(manifest.read_text())
        if at_most is not None and m["step"] > at_most:
            continue
        return Checkpoint(m["step"], directory, tuple(m["shards"]))
    return None
