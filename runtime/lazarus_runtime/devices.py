"""Which GPU each rank process of a node runs on, and which collective backend the job uses.

One rank per GPU is the rule on a cluster (a worker pod asks for ``gpusPerNode`` GPUs and
runs that many ranks). With more ranks than GPUs (``lazarus run --local`` on a machine with
fewer GPUs than the job has ranks, tests and demos) ranks share GPUs round-robin; with none,
every rank runs on the CPU. NCCL needs a GPU of its own for every rank ("Duplicate GPU
detected" otherwise, gpu-notes.md), so sharing or no GPU means gloo, which carries CPU and
CUDA tensors alike.

Pure functions, but for ``visible_gpus``, which asks the machine: the node agent and the
local backend make the I/O around them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lazarus_core.process_env import BACKENDS, GLOO, NCCL

__all__ = ["BACKENDS", "GLOO", "NCCL", "RankDevice", "collective_backend", "place_ranks",
           "share_machine", "parse_visible_gpus", "visible_gpus"]


@dataclass(frozen=True)
class RankDevice:
    """Where one rank process of a node runs."""

    local_rank: int
    # The GPU as CUDA_VISIBLE_DEVICES names it (an index or a UUID); None: the CPU.
    gpu: str | None


def place_ranks(ranks: int, gpus: Sequence[str]) -> list[RankDevice]:
    """``ranks`` processes over ``gpus``: rank i on ``gpus[i % len(gpus)]``, or the CPU."""
    if ranks < 1:
        raise ValueError(f"gpusPerNode: a node runs at least one rank, got {ranks}")
    return [RankDevice(i, gpus[i % len(gpus)] if gpus else None) for i in range(ranks)]


def collective_backend(placed: Sequence[RankDevice]) -> str:
    """NCCL when every rank has a GPU of its own, gloo otherwise."""
    gpus = [r.gpu for r in placed]
    if gpus and None not in gpus and len(set(gpus)) == len(gpus):
        return NCCL
    return GLOO


def share_machine(nodes: int, ranks_per_node: int, gpus: Sequence[str]
                  ) -> tuple[list[list[str]], str]:
    """Simulated nodes on one machine (``lazarus run --local``): the GPUs each node's agent
    may use, and the backend of the whole job. Ranks take the machine's GPUs in turn across
    nodes, so node i's ranks continue where node i-1's stopped, and a node's agent placing
    its ranks over its own share (``place_ranks``) lands each on that same GPU."""
    placed = [[gpus[(i * ranks_per_node + j) % len(gpus)] for j in range(ranks_per_node)]
              if gpus else [] for i in range(nodes)]
    every_rank = [RankDevice(j, gpu) for share in placed for j, gpu in enumerate(share)]
    backend = collective_backend(every_rank) if gpus else GLOO
    return [list(dict.fromkeys(share)) for share in placed], backend


def parse_visible_gpus(value: str) -> list[str]:
    """The GPUs a CUDA_VISIBLE_DEVICES value lets a process see, in order. An empty value
    or a negative index hides every GPU from there on, as CUDA reads it."""
    out = []
    for item in (v.strip() for v in value.split(",")):
        if not item or item.startswith("-"):
            break
        out.append(item)
    return out


def visible_gpus(cuda_visible_devices: str | None) -> list[str]:
    """The GPUs a process may use: those CUDA_VISIBLE_DEVICES names when it is set, or
    every GPU CUDA sees. torch is imported only where an NVIDIA driver is present."""
    if cuda_visible_devices is not None:
        return parse_visible_gpus(cuda_visible_devices)
    if not Path("/proc/driver/nvidia/version").exists():
        return []
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]
