"""The elastic runtime on a GPU: NCCL alone runs whole steps and rebuilds its communicator,
a checkpoint restores exactly onto the GPU, ranks sharing one GPU over gloo train what one
rank trains, and a SIGKILLed rank is survived.

Marked ``gpu``: skipped where torch sees no CUDA device. ``hack/gpu-check.sh`` runs them
and prints the figures they record (``gpu_figures``) in its table.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from elastic_jobs import Fault, manifest, run
from gloo_harness import free_port, run_gloo
from lazarus_core.runtime_config import RuntimeConfig
from lazarus_core.solver import plan_job
from lazarus_core.topology import NodeSpec
from lazarus_runtime import checkpoint
from lazarus_runtime.collectives import Collectives
from lazarus_runtime.engine import Engine
from lazarus_runtime.process_group import join_generation, leave_generation

pytestmark = pytest.mark.gpu

GPU = "cuda:0"
# Wide enough that the GPU does real work, small enough for seconds per test.
RUNTIME = {"model": "tiny", "dim": 256, "heads": 4, "ffnDim": 512, "seqLen": 128,
           "experts": 8, "globalBatch": 16, "generatedTokens": 400_000,
           "learningRate": "3e-3"}
# Per step, relative: ranks that split the batch add their partial sums in another order,
# which bf16 compute makes visible in the third significant digit.
BF16_TOLERANCE = 0.02


def record(name: str, **figures) -> None:
    """A figure for hack/gpu-check.sh's table, in the JSON file it names (if it does)."""
    path = os.environ.get("LAZARUS_GPU_FIGURES")
    if not path:
        return
    found = json.loads(Path(path).read_text()) if Path(path).exists() else {}
    found[name] = figures
    Path(path).write_text(json.dumps(found, indent=1))


def one_rank_plan(cfg: RuntimeConfig, generation: int = 1):
    E, L = cfg.model.experts, cfg.model.layers
    plan = plan_job([NodeSpec("gpu", gpus=1, slots_per_gpu=E)], experts=E, layers=L,
                    min_replicas=1)
    return dataclasses.replace(plan, generation=generation)


def test_nccl_alone_runs_whole_steps_and_rebuilds_its_communicator():
    cfg = RuntimeConfig.from_manifest(RUNTIME)
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    comm = join_generation(store, 1, 0, 1, backend="nccl", device=GPU)
    assert comm.group is not None and comm.poll_completion  # a real communicator of one
    engine = Engine(cfg, one_rank_plan(cfg), 0, comm, device=GPU)
    losses = [engine.step(s).loss for s in range(1, 6)]
    leave_generation(comm)  # aborts the communicator, as every generation's end does
    comm = join_generation(store, 2, 0, 1, backend="nccl", device=GPU)
    engine.reconfigure(one_rank_plan(cfg, generation=2), 0, comm, {})
    losses += [engine.step(s).loss for s in range(6, 11)]
    leave_generation(comm)

    alone = Engine(cfg, one_rank_plan(cfg), 0, Collectives.single(), device=GPU)
    expected = [alone.step(s).loss for s in range(1, 11)]
    # A sum over one rank is the identity: the group changes nothing but the path.
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert losses[-1] < losses[0]


def _snapshot(engine: Engine) -> dict[str, torch.Tensor]:
    state = {f"dense/{k}": v for k, v in engine.dense_state().items()}
    for key in engine.held_experts():
        state |= {f"{key}/{k}": v for k, v in engine.expert_state(key).items()}
    return state


def test_a_checkpoint_restores_exactly_onto_the_gpu(tmp_path):
    cfg = RuntimeConfig.from_manifest(RUNTIME)
    plan = one_rank_plan(cfg)
    engine = Engine(cfg, plan, 0, Collectives.single(), device=GPU)
    for s in range(1, 5):
        engine.step(s)
    owned = {key: engine.expert_state(key) for key in checkpoint.owned_experts(plan, 0)}
    info = checkpoint.write_shard(tmp_path, 4, 0, owned, engine.dense_state())
    checkpoint.write_manifest(tmp_path, 4, [info])
    saved = {k: v.cpu() for k, v in _snapshot(engine).items()}
    after = [engine.step(s).loss for s in range(5, 8)]

    restored = Engine(cfg, plan, 0, Collectives.single(), device=GPU)
    ck = checkpoint.latest(tmp_path)
    restored.load_state(*ck.load(set(restored.held_experts()), GPU))
    state = _snapshot(restored)
    assert state.keys() == saved.keys()
    for name, value in state.items():
        assert torch.equal(value.cpu(), saved[name]), name  # bit for bit
        if not name.endswith("/step"):  # AdamW keeps its step counts where it likes
            assert value.device.type == "cuda", name
    again = [restored.step(s).loss for s in range(5, 8)]
    assert again[0] == after[0]  # the same weights give the same first step, bit for bit
    np.testing.assert_allclose(again, after, rtol=1e-5)


def _train_on_the_shared_gpu(rank: int, comm: Collectives, runtime: dict, plan_json: str,
                             steps: int) -> list[float]:
    from lazarus_core.plan import Plan

    cfg = RuntimeConfig.from_manifest(runtime)
    engine = Engine(cfg, Plan.from_json(plan_json), rank, comm, device=GPU)
    return [engine.step(s).loss for s in range(1, steps + 1)]


@pytest.mark.timeout(600)
def test_four_ranks_sharing_the_gpu_over_gloo_train_what_one_rank_trains():
    cfg = RuntimeConfig.from_manifest(RUNTIME)
    E, L, steps = cfg.model.experts, cfg.model.layers, 50
    # 4 ranks x 4 slots for 8 experts: every expert has two replicas on two ranks.
    plan = plan_job([NodeSpec(f"n{i}", gpus=1, slots_per_gpu=4) for i in range(4)],
                    experts=E, layers=L, min_replicas=2)
    assert min(min(layer.replicas) for layer in plan.layers) == 2
    shared = run_gloo(_train_on_the_shared_gpu, world_size=4, timeout_s=500,
                      args=(RUNTIME, plan.to_json(), steps))
    assert all(losses == shared[0] for losses in shared)  # every rank reports the global loss
    alone = Engine(cfg, one_rank_plan(cfg), 0, Collectives.single(), device=GPU)
    reference = np.array([alone.step(s).loss for s in range(1, steps + 1)])
    losses = np.array(shared[0])
    worst = float(np.max(np.abs(losses - reference) / reference))
    record("4 ranks on one GPU (gloo) vs 1 rank", steps=steps,
           largest_relative_loss_difference=round(worst, 5),
           first_loss=round(float(losses[0]), 4), last_loss=round(float(losses[-1]), 4))
    assert worst < BF16_TOLERANCE, (losses, reference)
    assert losses[-10:].mean() < 0.98 * losses[:5].mean(), losses  # it learns


@pytest.mark.timeout(600)
def test_a_sigkilled_rank_on_the_gpu_is_survived(tmp_path):
    # 2 nodes x 2 ranks, all on the one GPU: the local backend sees that they share it and
    # runs them over gloo (devices.share_machine). One rank is killed, as a GPU that fails.
    path = manifest(tmp_path, "gpu-kill", runtime={**RUNTIME, "experts": 4, "layers": 2},
                    gpusPerNode=2, minNodes=1)
    result = run(path, workers=2, kills=[Fault(10, names=("worker-1/1",))], steps=20,
                 gpus=None)
    assert result.steps_completed == 20
    assert result.samples_lost == 0 and result.samples_duplicated == 0
    (reconfig,) = result.reconfigurations
    assert reconfig["reason"] == "GpuLost" and result.workers == 3, reconfig
    record("SIGKILLed rank on the GPU", seconds_to_next_step=reconfig["seconds"],
           **reconfig["breakdown"])
    assert reconfig["seconds"] < 10.0, reconfig
