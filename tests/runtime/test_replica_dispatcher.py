"""The Algorithm-1 dispatcher on real gloo ranks against the single-rank reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gloo_harness import run_gloo
from lazarus_runtime.collectives import Collectives
from lazarus_runtime.dispatch_counts import dispatch_counts
from lazarus_runtime.dispatcher import LocalDispatcher, ReplicaDispatcher

E, K, D = 4, 2, 5
# Rank 0 holds no replica of expert 3, the hot one; rank 1 holds it in two slots.
REPLICAS_EW = np.array([[1, 0, 1],
                        [1, 1, 0],
                        [1, 1, 1],
                        [0, 2, 1]])


def tokens_of(rank: int):
    g = torch.Generator().manual_seed(rank)
    T = 6 + 5 * rank
    x_TD = torch.randn(T, D, generator=g)
    # Mostly expert 3, so rank 0 must ship most of its assignments away.
    experts_TK = torch.stack([torch.full((T,), 3), torch.randint(0, 3, (T,), generator=g)], 1)
    weights_TK = torch.softmax(torch.randn(T, K, generator=g), -1)
    return x_TD, weights_TK, experts_TK


def apply_experts(dispatcher, routed_XD, num_rows_L):
    # Distinct per-expert maps, so a row sent to the wrong expert changes the result.
    chunks = torch.split(routed_XD, num_rows_L)
    return torch.cat([c * (e + 1) + e for e, c in zip(dispatcher.local_experts, chunks)])


def route(dispatcher, rank):
    x_TD, weights_TK, experts_TK = tokens_of(rank)
    x_TD.requires_grad_(True)
    weights_TK.requires_grad_(True)
    routed, rows, meta = dispatcher.dispatch(x_TD, weights_TK, experts_TK)
    num_rows = rows.counts_L.tolist()
    # Where the dispatcher knows the counts on the host, they are the device's.
    assert rows.host_counts is None or list(rows.host_counts) == num_rows
    out_TD = dispatcher.combine(apply_experts(dispatcher, routed, num_rows), meta)
    (out_TD * torch.arange(D)).sum().backward()
    return out_TD.detach().numpy(), x_TD.grad.numpy(), weights_TK.grad.numpy(), meta, num_rows


def distributed(rank: int, comm: Collectives) -> dict:
    from lazarus_runtime.kernels import kernel_backend
    out, gx, gw, meta, num_rows = route(ReplicaDispatcher(REPLICAS_EW, comm), rank)
    return {"backend": kernel_backend(), "out": out, "grad_x": gx, "grad_w": gw, "send": meta.send_splits,
            "recv": meta.recv_splits, "rows": sum(num_rows),
            "tokens": meta.num_tokens_E.numpy()}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_replica_dispatch_matches_the_local_reference(backend, monkeypatch):
    # The workers import the kernels afresh: with TRITON_INTERPRET=1 they run the Triton
    # kernels (the GPU path) in the interpreter; the reference here stays on torch.
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    ranks = run_gloo(distributed, world_size=3, timeout_s=90)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert {r["backend"] for r in ranks} == {backend}
    for rank, got in enumerate(ranks):
        out, gx, gw, _, _ = route(LocalDispatcher(E), rank)
        np.testing.assert_allclose(got["out"], out, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got["grad_x"], gx, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got["grad_w"], gw, rtol=1e-5, atol=1e-5)
    # Splits agree: what i sends to j is what j expects from i.
    for i in range(3):
        for j in range(3):
            assert ranks[i]["send"][j] == ranks[j]["recv"][i]
    # Each rank computes exactly its replicas' share of the global assignments.
    tokens_EW = np.stack([np.bincount(tokens_of(r)[2].reshape(-1), minlength=E)
                          for r in range(3)], 1)
    counts_EWW = dispatch_counts(tokens_EW, REPLICAS_EW)
    assert [r["rows"] for r in ranks] == counts_EWW.sum(axis=(0, 1)).tolist()
    # Rank 0 really shipped all its hot-expert assignments to the ranks holding it.
    assert counts_EWW[3, 0, 0] == 0 and counts_EWW[3, 0, 1:].sum() == tokens_EW[3, 0] > 0
    for r in ranks:
        np.testing.assert_array_equal(r["tokens"], tokens_EW.sum(1))
