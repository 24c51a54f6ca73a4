"""A step waits on the device at most once per MoE layer in the forward, never in the backward.

The counter (host_sync.HostSyncCounter) plays the device on the CPU: see its docstring for
what counts. Run against the engine before this bound was set (main at 10f99ee), it counted
99 per step for the model below, as the profiler counted 99 cudaStreamSynchronize calls per
gpt-s step on an H200 (gpu-notes.md).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gloo_harness import run_gloo
from lazarus_core.runtime_config import RuntimeConfig
from lazarus_core.solver import plan_job
from lazarus_core.topology import NodeSpec
from lazarus_runtime.collectives import Collectives
from lazarus_runtime.engine import Engine
from lazarus_runtime.host_sync import HostSyncCounter, to_device
from lazarus_runtime.kernels import bucket_positions, permute

# gpt-s's depth, experts and top-1 routing at a width a CPU trains in milliseconds.
MANIFEST = {"model": "gpt-s", "dim": 32, "heads": 2, "ffnDim": 64, "vocab": 256, "seqLen": 32,
            "globalBatch": 4, "generatedTokens": 5_000}
CFG = RuntimeConfig.from_manifest(MANIFEST)
E, L = CFG.model.experts, CFG.model.layers


def counted_step(engine: Engine, step: int) -> dict[str, int]:
    """Host synchronisations of one step: forward, backward, and the whole step."""
    counter = HostSyncCounter("cpu", on_device=engine.resident_tensors())
    batch = engine.batches.batch(step, engine.rank, engine.comm.world_size)
    with counter, counter.phase("forward"):
        loss = engine.model(batch.inputs_BS, batch.targets_BS)
    with counter, counter.phase("backward"):
        loss.backward()
    with counter, counter.phase("step"):
        engine.step(step)
    return {"forward": counter.counts["forward"], "backward": counter.counts["backward"],
            "step": counter.counts["step"], "events": counter.events}


def test_the_counter_sees_what_makes_a_gpu_wait():
    w = torch.randn(4, 3)
    counter = HostSyncCounter("cpu", on_device=[w])
    with counter:
        y = torch.randn(5, 4, device="cpu") @ w
        host = torch.from_numpy(np.arange(5))
        host.tolist(), host[1:].tolist()  # host data: free
        y.sum().item()
        y.argmax(1).tolist()
        y.cpu().numpy()  # one read; the host copy is then free to read
        torch.nonzero(y > 0)
        torch.from_numpy(np.arange(3)).to("cpu")  # a blocking copy to the device
        to_device(np.arange(3), torch.device("cpu"))  # pinned and non-blocking: free
        bucket_positions(torch.tensor([[0], [2]], device="cpu"), 3)  # its range check
    assert [e for _, e in counter.events] == [
        "_local_scalar_dense", "Tensor.tolist", "Tensor.cpu", "nonzero",
        "Tensor.to(device) of host data, blocking", "torch.tensor(..., device=)",
        "_local_scalar_dense", "_local_scalar_dense"]


def test_range_checks_run_on_indices_from_outside_only():
    rows_TK = torch.arange(6).view(3, 2).flip(0)
    x_TD = torch.randn(3, 4)
    counter = HostSyncCounter("cpu", on_device=[rows_TK, x_TD])
    with counter:
        permute(x_TD, rows_TK)
    assert counter.total() == 2  # aminmax's two extremes, read back
    with counter, counter.phase("trusted"):
        permute(x_TD, rows_TK, check_range=False)
    assert counter.counts["trusted"] == 0


def test_one_rank_never_waits_but_for_the_end_of_step_read():
    plan = plan_job([NodeSpec("solo", gpus=1, slots_per_gpu=E)], experts=E, layers=L,
                    min_replicas=1)
    engine = Engine(CFG, plan, 0, Collectives.single())
    engine.step(0)  # the optimizer's state exists from here on
    counts = counted_step(engine, 1)
    assert (counts["forward"], counts["backward"]) == (0, 0), counts["events"]
    assert counts["step"] == 1, counts["events"]


def replica_step(rank: int, comm: Collectives, plan_json: str) -> dict:
    from lazarus_core.plan import Plan
    engine = Engine(CFG, Plan.from_json(plan_json), rank, comm)
    engine.step(0)
    return counted_step(engine, 1)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_replicated_experts_wait_once_per_layer_for_their_split_sizes():
    nodes = [NodeSpec(f"node-{i}", gpus=1, slots_per_gpu=E) for i in range(2)]
    plan = plan_job(nodes, experts=E, layers=L, min_replicas=2)
    for counts in run_gloo(replica_step, world_size=2, args=(plan.to_json(),), timeout_s=100):
        assert counts["forward"] == L, counts["events"]
        assert counts["backward"] == 0, counts["events"]
        assert counts["step"] == L + 1, counts["events"]
