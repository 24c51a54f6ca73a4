"""bf16 training: fp32 masters and optimizer state, fp32 router and loss, and it tracks fp32."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import solo_engines
from lazarus_core.runtime_config import ComputeConfig
from lazarus_runtime.engine import Engine

MANIFEST = {"model": "tiny", "globalBatch": 8, "generatedTokens": 20_000, "learningRate": "1e-2"}
pytestmark = pytest.mark.usefixtures("one_thread")


def solo_engine(**runtime) -> Engine:
    return solo_engines.solo_engine({**MANIFEST, **runtime})


def test_precision_defaults_to_bf16_on_gpus_and_fp32_on_cpus():
    assert ComputeConfig().precision_on("cuda") == "bf16"
    assert ComputeConfig().precision_on("cpu") == "fp32"
    assert ComputeConfig(precision="fp32").precision_on("cuda") == "fp32"
    assert solo_engine().precision == "fp32"


def test_bf16_tracks_fp32_and_learns():
    steps = 100
    fp32, bf16 = (solo_engine(precision=p) for p in ("fp32", "bf16"))
    fp32 = np.array([fp32.step(s).loss for s in range(steps)])
    bf16 = np.array([bf16.step(s).loss for s in range(steps)])
    # Stated tolerance: every step within 0.25 nats (the batches differ from step to step
    # by far more), and the last 20 steps within 2% of fp32 on average.
    assert np.abs(bf16 - fp32).max() < 0.25
    assert abs(bf16[-20:].mean() - fp32[-20:].mean()) < 0.02 * fp32[-20:].mean()
    # It learns: from log(256) = 5.55 down by more than 0.8 nats.
    assert bf16[-20:].mean() < bf16[:10].mean() - 0.8


def test_bf16_computes_in_bf16_and_keeps_fp32_weights_and_optimizer_state():
    engine = solo_engine(precision="bf16")
    engine.step(0)
    params = dict(engine.model.named_parameters())
    assert params["blocks.0.qkv.weight"].dtype == torch.bfloat16
    assert params["blocks.0.moe.experts.w1_LDF"].dtype == torch.bfloat16
    assert params["blocks.0.moe.gate.weight"].dtype == torch.float32  # the router
    for key in engine.held_experts():
        assert {t.dtype for t in engine.expert_state(key).values()} == {torch.float32}
    dense = engine.dense_state()
    assert {t.dtype for t in dense.values()} == {torch.float32}
    # The masters hold what bf16 cannot: the model's copy is their rounding.
    master = dense["blocks.0.qkv.weight"]
    assert torch.equal(params["blocks.0.qkv.weight"], master.to(torch.bfloat16))
    assert not torch.equal(master, master.to(torch.bfloat16).float())


def test_a_bf16_worker_given_the_masters_continues_bit_for_bit():
    veteran = solo_engine(precision="bf16")
    for s in range(3):
        veteran.step(s)
    joiner = solo_engine(precision="bf16")
    joiner.load_state(veteran.dense_state(),
                      {k: veteran.expert_state(k) for k in veteran.held_experts()})
    assert [joiner.step(s).loss for s in (3, 4)] == [veteran.step(s).loss for s in (3, 4)]


def test_dense_state_with_partial_optimizer_state_is_refused():
    veteran = solo_engine()
    veteran.step(0)
    state = veteran.dense_state()
    del state["ln_f.weight/exp_avg"], state["ln_f.weight/exp_avg_sq"], state["ln_f.weight/step"]
    with pytest.raises(ValueError, match="optimizer state for only"):
        solo_engine().load_dense_state(state)
