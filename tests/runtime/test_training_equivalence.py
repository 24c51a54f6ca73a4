"""Training with replicated experts on 4 gloo ranks is the same computation as on 1 rank.

Both plans come from the real solver: an MRO plan with every expert replicated, and a
strongly skewed one where the hot expert has 6 replicas and the others the minimum. All
four ranks run both plans in one spawn (process start-up dominates the cost on 2 cores).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gloo_harness import run_gloo
from lazarus_core.plan import Plan
from lazarus_core.solver import plan_job
from lazarus_core.topology import NodeSpec
from lazarus_runtime.collectives import Collectives
from lazarus_runtime.config import RuntimeConfig
from lazarus_runtime.engine import Engine

STEPS = 20
MANIFEST = {"model": "tiny", "globalBatch": 8, "generatedTokens": 20_000,
            "learningRate": "3e-3", "seed": 7}
CFG = RuntimeConfig.from_manifest(MANIFEST)
E, L = CFG.model.experts, CFG.model.layers
NODES = [NodeSpec(f"node-{i}", gpus=1, slots_per_gpu=3) for i in range(4)]


def mro_plan() -> Plan:
    return plan_job(NODES, experts=E, layers=L, min_replicas=2)


def skewed_plan() -> Plan:
    return plan_job(NODES, experts=E, layers=L, min_replicas=2, loads=[[1, 1, 1, 40]] * L)


def train(rank: int, comm: Collectives, plan_json: str) -> dict:
    """Run STEPS steps; return losses, sample ids and every parameter this rank holds."""
    engine = Engine(RuntimeConfig.from_manifest(MANIFEST), Plan.from_json(plan_json), rank, comm)
    results = [engine.step(s) for s in range(STEPS)]
    return {
        "losses": [r.loss for r in results],
        "samples": [r.sample_ids for r in results],
        "dense": {n: p.detach().numpy().copy() for n, p in engine.model.dense_parameters()},
        # Parameters and AdamW state of every expert replica held here.
        "experts": {k: {n: t.numpy().copy() for n, t in engine.expert_state(k).items()}
                    for k in engine.held_experts()},
        "loads": engine.take_loads(),
    }


def train_plans(rank: int, comm: Collectives, plan_jsons: list[str]) -> list[dict]:
    return [train(rank, comm, p) for p in plan_jsons]


@pytest.fixture(scope="module")
def reference() -> dict:
    solo = plan_job([NodeSpec("solo", gpus=1, slots_per_gpu=E)], experts=E, layers=L,
                    min_replicas=1)
    return train(0, Collectives.single(), solo.to_json())


@pytest.fixture(scope="module")
def distributed() -> dict[str, list[dict]]:
    plans = {"mro": mro_plan(), "skewed": skewed_plan()}
    per_rank = run_gloo(train_plans, world_size=4,
                        args=([p.to_json() for p in plans.values()],), timeout_s=150)
    return {name: [ranks[i] for ranks in per_rank] for i, name in enumerate(plans)}


def test_plans_replicate_as_intended():
    assert all(r == (3,) * E for r in (l.replicas for l in mro_plan().layers))
    assert all(l.replicas == (2, 2, 2, 6) for l in skewed_plan().layers)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("plan", ["mro", "skewed"])
def test_four_ranks_train_like_one(plan, reference, distributed):
    ranks = distributed[plan]
    for r in ranks:
        np.testing.assert_allclose(r["losses"], reference["losses"], rtol=0, atol=1e-4)
    # Every step covers exactly the reference's samples, each once.
    for step in range(STEPS):
        seen = [i for r in ranks for i in r["samples"][step]]
        assert seen == list(reference["samples"][step])
    for r in ranks:
        for name, value in r["dense"].items():
            np.testing.assert_allclose(value, reference["dense"][name], rtol=0, atol=1e-4,
                                       err_msg=name)
        for key, params in r["experts"].items():
            for name, value in params.items():
                np.testing.assert_allclose(value, reference["experts"][key][name], rtol=0,
                                           atol=1e-4, err_msg=f"expert {key} {name}")
    # Loads are global counts, so every rank reports the reference's.
    for r in ranks:
        np.testing.assert_array_equal(r["loads"], reference["loads"])


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("plan", ["mro", "skewed"])
def test_replicas_stay_bit_identical(plan, distributed):
    ranks = distributed[plan]
    for key in {k for r in ranks for k in r["experts"]}:
        copies = [r["experts"][key] for r in ranks if key in r["experts"]]
        for name in copies[0]:
            for other in copies[1:]:
                assert np.array_equal(copies[0][name], other[name]), (key, name)
    for name in ranks[0]["dense"]:
        for r in ranks[1:]:
            assert np.array_equal(ranks[0]["dense"][name], r["dense"][name]), name
