"""The checkpoint-restart baseline's training script, as torchrun launches it.

The same model, data, engine, plan and checkpoints as a Lazarus worker, with none of its
elasticity: one process group for the life of the process, and the newest checkpoint loaded
at start. Any failure (a peer's closed connection, a collective timeout) ends the script with
an error, and torchrun's elastic agent restarts every worker of the job: the behaviour
``bench_goodput`` measures.

Environment: torchrun's (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RESTART_COUNT), BENCH_MANIFEST (the LazarusJob manifest: runtime, slots,
replicas, placement, checkpoint path and interval) and BENCH_EVENTS, a file to which every
worker appends one JSON line when it is up and rank 0 one per completed step (with its loss).
"""
from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from lazarus_core.job_spec import parse_manifest
from lazarus_core.solver import plan_job
from lazarus_core.topology import NodeSpec
from lazarus_runtime import checkpoint
from lazarus_runtime.collectives import Collectives
from lazarus_core.runtime_config import RuntimeConfig
from lazarus_runtime.data import StepBatches
from lazarus_runtime.engine import Engine

# A dead peer closes its gloo connections at once; this bounds only a frozen one.
TIMEOUT_S = 60.0


def record(path: str, **event) -> None:
    # One short write in append mode: lines from several processes never interleave.
    with open(path, "a") as f:
        f.write(json.dumps(dict(event, t=time.monotonic())) + "\n")


def main() -> None:
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = os.environ["BENCH_EVENTS"]
    _, spec = parse_manifest(yaml.safe_load(Path(os.environ["BENCH_MANIFEST"]).read_text()))
    cfg = RuntimeConfig.from_manifest(dict(spec.runtime))
    store = checkpoint.Checkpoints.open(spec.checkpoint.path, None, spec.checkpoint.keep)
    every = spec.checkpoint.every_steps
    record(events, event="up", rank=rank, world=world, restart=restart)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    # Zero-padded names keep the solver's node order equal to torchrun's rank order.
    nodes = [NodeSpec(f"node-{r:03d}", gpus=1, slots_per_gpu=spec.slots_per_node,
                      zone="local") for r in range(world)]
    plan = plan_job(nodes, spec.experts, spec.layers, spec.min_replicas, spec.policy)
    if plan.nodes[plan.node_index(f"node-{rank:03d}")].ranks != (rank,):
        raise RuntimeError(f"plan rank order differs from torchrun's at rank {rank}")
    comm = (Collectives(dist.group.WORLD, rank, world, TIMEOUT_S) if world > 1
            else Collectives.single())
    engine = Engine(cfg, plan, rank, comm,
                    StepBatches.from_config(cfg.data, cfg.model.seq_len, cfg.model.vocab))
    step = 1
    latest = store.latest()
    if latest is not None:
        engine.load_state(*latest.load(set(engine.held_experts())))
        step = latest.step + 1
    if rank == 0:
        record(events, event="restored", step=step - 1, restart=restart)

    while True:
        loss = engine.prepare(step).loss
        engine.apply()
        if every and step % every == 0:
            owned = {key: engine.expert_state(key)
                     for key in checkpoint.owned_experts(plan, rank)}
            info = store.write_shard(step, rank, owned,
                                     engine.dense_state() if rank == 0 else None)
            shards = [None] * world
            dist.all_gather_object(shards, info)
            if rank == 0:
                store.write_manifest(step, shards)
        if rank == 0:
            record(events, event="step", step=step, restart=restart, loss=loss)
        step += 1


if __name__ == "__main__":
    main()
