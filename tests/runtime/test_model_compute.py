"""How a step computes changes nothing it computes: grouped GEMMs, the chunked vocabulary
loss, activation checkpointing and torch.compile against the plain way."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import solo_engines
from lazarus_runtime import vocab_loss
from lazarus_runtime.engine import Engine
from lazarus_runtime.experts import ExpertRows, GroupedExperts, grouped_mm_supported
from lazarus_runtime.vocab_loss import linear_cross_entropy_sum

MANIFEST = {"model": "tiny", "globalBatch": 4, "generatedTokens": 5_000,
            "learningRate": "3e-3"}
pytestmark = pytest.mark.usefixtures("one_thread")


def solo_engine(**runtime) -> Engine:
    return solo_engines.solo_engine({**MANIFEST, **runtime})


def losses(engine: Engine, steps: int = 3) -> list[float]:
    return [engine.step(s).loss for s in range(steps)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grouped_gemm_and_the_per_expert_loop_agree(dtype):
    if not grouped_mm_supported(torch.device("cpu"), dtype, 32, 64):
        pytest.skip("this torch has no grouped GEMM on the CPU")
    experts = GroupedExperts(32, 64, layer=0, expert_ids=[0, 2, 3, 5], seed=1).to(dtype)
    # An expert with no rows, and one with a single row.
    rows = ExpertRows(torch.tensor([5, 0, 1, 9]), host_counts=(5, 0, 1, 9))
    x_XD = torch.randn(15, 32, dtype=dtype)
    results = []
    for grouped in (True, False):
        experts.use_grouped_mm = grouped
        x = x_XD.clone().requires_grad_()
        y = experts(x, rows)
        grads = torch.autograd.grad(y.float().square().sum(), [x, *experts.parameters()])
        results.append((y, *grads))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_grouped_gemm_trains_exactly_as_the_loop_on_the_cpu():
    # A refactor that should not change numerics: the same losses, bit for bit.
    if not grouped_mm_supported(torch.device("cpu"), torch.float32, 32, 64):
        pytest.skip("this torch has no grouped GEMM on the CPU")
    looped = solo_engine()
    for moe in looped.model.moe_layers():
        moe.experts.use_grouped_mm = False
    grouped = solo_engine()
    assert losses(grouped) == losses(looped)
    assert all(moe.experts.use_grouped_mm for moe in grouped.model.moe_layers())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_chunked_vocabulary_loss_is_the_cross_entropy(dtype, monkeypatch):
    # Chunks of 64 tokens, so 150 tokens take three, the last one short.
    monkeypatch.setattr(vocab_loss, "CHUNK_LOGITS", 64 * 100)
    g = torch.Generator().manual_seed(0)
    h_TD = torch.randn(150, 16, generator=g).to(dtype).requires_grad_()
    w_VD = torch.randn(100, 16, generator=g).to(dtype).requires_grad_()
    targets_T = torch.randint(0, 100, (150,), generator=g)
    loss = linear_cross_entropy_sum(h_TD, w_VD, targets_T)
    expected = F.cross_entropy((h_TD @ w_VD.T).float(), targets_T, reduction="sum")
    assert loss.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(loss, expected, rtol=tol, atol=tol)
    scale = 0.37  # the backward scales by the incoming gradient
    got = torch.autograd.grad(loss * scale, (h_TD, w_VD))
    wanted = torch.autograd.grad(expected * scale, (h_TD, w_VD))
    for a, b in zip(got, wanted):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
    with torch.no_grad():
        assert linear_cross_entropy_sum(h_TD, w_VD, targets_T) == loss


@pytest.mark.parametrize("mode", ["attention", "full"])
def test_activation_checkpointing_recomputes_the_same_step(mode):
    assert losses(solo_engine(activationCheckpointing=mode)) == losses(solo_engine())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compiling_the_dense_blocks_trains_the_same():
    plain = losses(solo_engine())
    compiled = losses(solo_engine(compile="dense"))
    assert compiled == pytest.approx(plain, abs=1e-5)
