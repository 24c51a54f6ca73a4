"""The training step on a GPU: sync-free, grouped GEMMs, and bf16 that tracks fp32.

Marked ``gpu``: skipped where torch sees no CUDA device. ``hack/gpu-check.sh`` runs them.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lazarus_core.runtime_config import RuntimeConfig
from lazarus_core.solver import plan_job
from lazarus_core.topology import NodeSpec
from lazarus_runtime.collectives import Collectives
from lazarus_runtime.engine import Engine
from lazarus_runtime.experts import ExpertRows, GroupedExperts, grouped_mm_supported
from lazarus_runtime.host_sync import HostSyncCounter, count_cuda_syncs

pytestmark = pytest.mark.gpu


def gpu_engine(runtime: dict) -> Engine:
    cfg = RuntimeConfig.from_manifest(runtime)
    E, L = cfg.model.experts, cfg.model.layers
    plan = plan_job([NodeSpec("gpu", gpus=1, slots_per_gpu=E)], experts=E, layers=L,
                    min_replicas=1)
    return Engine(cfg, plan, 0, Collectives.single(), device="cuda")


def test_a_step_on_one_gpu_waits_on_the_host_once():
    # gpt-s's depth and experts (12 MoE layers, 8 experts, top-1), narrower.
    engine = gpu_engine({"model": "gpt-s", "dim": 256, "heads": 4, "ffnDim": 1024,
                         "globalBatch": 4, "generatedTokens": 100_000})
    assert engine.precision == "bf16"
    engine.step(0)  # first-use work (kernel compiles, the grouped-GEMM probe) happens here
    counter = HostSyncCounter("cuda")
    with count_cuda_syncs() as found, counter:
        engine.step(1)
    assert len(found) <= 1, found  # the end-of-step read of loss and loads
    assert counter.total() == 1, counter.events


def test_experts_run_as_grouped_gemms_and_agree_with_the_loop():
    device, dtype = torch.device("cuda"), torch.bfloat16
    assert grouped_mm_supported(device, dtype, 1024, 4096)
    experts = GroupedExperts(1024, 4096, layer=0, expert_ids=range(8), seed=0).to(device, dtype)
    counts = torch.tensor([700, 0, 1, 300, 24, 1000, 7, 16], device=device)
    x_XD = torch.randn(int(counts.sum()), 1024, device=device, dtype=dtype)
    outputs = []
    for grouped in (True, False):
        experts.use_grouped_mm = grouped
        outputs.append(experts(x_XD, ExpertRows(counts, tuple(counts.tolist()))))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=2e-2, atol=2e-2)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", ["gpt-s", "gpt-l"])
def test_bf16_tracks_fp32_and_learns(model):
    # gpu-notes.md: one gpt-l bf16 run (autocast from outside) ended at loss 19.2, another at
    # 8.5. Here bf16 is the engine's own recipe, against fp32 from the same seed.
    runtime = {"model": model, "globalBatch": 8, "generatedTokens": 2_000_000}
    steps = 30
    losses = {}
    for precision in ("fp32", "bf16"):
        engine = gpu_engine({**runtime, "precision": precision})
        losses[precision] = np.array([engine.step(s).loss for s in range(steps)])
        del engine
        torch.cuda.empty_cache()
    fp32, bf16 = losses["fp32"], losses["bf16"]
    assert np.isfinite(bf16).all()
    assert np.abs(bf16 - fp32).max() < 0.3, (fp32, bf16)
    assert abs(bf16[-10:].mean() - fp32[-10:].mean()) < 0.03 * fp32[-10:].mean(), (fp32, bf16)
    assert bf16[-10:].mean() < bf16[0] - 1.0, bf16
