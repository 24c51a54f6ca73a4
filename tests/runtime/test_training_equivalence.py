"""Training with replicated experts on 4 gloo ranks is the same computation as on 1 rank.

Both plans come from the real solver: an MRO plan with every expert replicated, and a
strongly skewed one where the hot expert has 6 replicas and the others the minimum, and a
switch from the first to the second halfway through (a rebalance, as Runtime II drives it).
All four ranks run every scenario in one spawn (process start-up dominates on 2 cores).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gloo_harness import run_gloo
from lazarus_core.plan import Plan
from lazarus_core.solver import build_plan, place, plan_job
from lazarus_core.topology import NodeSpec
from lazarus_runtime.collectives import Collectives
from lazarus_core.runtime_config import RuntimeConfig
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
    # Counts as given, so that the switch changes them: for loads (1, 1, 1, 40) the
    # solver, recovery first, gives (3, 3, 3, 3) here (no fatal pair of nodes).
    replicas = [[2, 2, 2, 6]] * L
    return build_plan(NODES, replicas, place("mro", replicas, [n.slots for n in NODES]), E,
                      2, "mro", 1, "Initial", 0)


def train(rank: int, comm: Collectives, plan_json: str, then_json: str | None = None) -> dict:
    """Run STEPS steps; return losses, sample ids and every parameter this rank holds.

    With ``then_json``, switch to that plan generation halfway, fetching the experts this
    rank newly holds from the others (a plain all-gather stands in for Runtime II's
    transfers).
    """
    engine = Engine(RuntimeConfig.from_manifest(MANIFEST), Plan.from_json(plan_json), rank, comm)
    results = [engine.step(s) for s in range(STEPS // 2)]
    if then_json is not None:
        offered = [None] * comm.world_size
        torch.distributed.all_gather_object(
            offered, {k: engine.expert_state(k) for k in engine.held_experts()})
        everything = {k: state for held in offered for k, state in held.items()}
        engine.reconfigure(Plan.from_json(then_json), rank, comm, everything)
    results += [engine.step(s) for s in range(STEPS // 2, STEPS)]
    return {
        "losses": [r.loss for r in results],
        "samples": [r.sample_ids for r in results],
        "dense": {n: p.detach().numpy().copy() for n, p in engine.model.dense_parameters()},
        # Parameters and AdamW state of every expert replica held here.
        "experts": {k: {n: t.numpy().copy() for n, t in engine.expert_state(k).items()}
                    for k in engine.held_experts()},
        "loads": engine.take_loads(),
    }


def train_plans(rank: int, comm: Collectives, runs: list[tuple[str, str | None]]) -> list[dict]:
    return [train(rank, comm, *run) for run in runs]


@pytest.fixture(scope="module")
def reference() -> dict:
    solo = plan_job([NodeSpec("solo", gpus=1, slots_per_gpu=E)], experts=E, layers=L,
                    min_replicas=1)
    return train(0, Collectives.single(), solo.to_json())


@pytest.fixture(scope="module")
def distributed() -> dict[str, list[dict]]:
    mro, skewed = mro_plan().to_json(), skewed_plan().to_json()
    rebalanced = plan_job(NODES, experts=E, layers=L, min_replicas=2, loads=[[1, 1, 1, 40]] * L,
                          generation=2, reason="Rebalance").to_json()
    runs = {"mro": (mro, None), "skewed": (skewed, None), "mro-then-skewed": (mro, rebalanced)}
    per_rank = run_gloo(train_plans, world_size=4, args=(list(runs.values()),), timeout_s=150)
    return {name: [ranks[i] for ranks in per_rank] for i, name in enumerate(runs)}


def test_plans_replicate_as_intended():
    assert all(r == (3,) * E for r in (l.replicas for l in mro_plan().layers))
    assert all(l.replicas == (2, 2, 2, 6) for l in skewed_plan().layers)
    # The switch really moves experts: some rank must receive one it did not hold.
    before, after = mro_plan(), skewed_plan()
    assert any(set(after.rank_experts(l, r)) - set(before.rank_experts(l, r))
               for l in range(L) for r in range(4))


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("plan", ["mro", "skewed", "mro-then-skewed"])
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
@pytest.mark.parametrize("plan", ["mro", "skewed", "mro-then-skewed"])
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
