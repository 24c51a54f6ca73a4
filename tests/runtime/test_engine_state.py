"""Engine state round trips: a worker built fresh and given the state carries on exactly."""
from __future__ import annotations

import pytest

import solo_engines
from lazarus_core.solver import plan_job
from lazarus_core.topology import NodeSpec
from lazarus_runtime.collectives import Collectives
from lazarus_core.runtime_config import RuntimeConfig
from lazarus_runtime.engine import Engine

MANIFEST = {"model": "tiny", "globalBatch": 4, "generatedTokens": 5_000, "learningRate": "3e-3"}
CFG = RuntimeConfig.from_manifest(MANIFEST)
E, L = CFG.model.experts, CFG.model.layers


def solo_engine() -> Engine:
    return solo_engines.solo_engine(MANIFEST)


def test_a_joining_worker_given_dense_and_expert_state_continues_bit_for_bit():
    veteran = solo_engine()
    for s in range(3):
        veteran.step(s)
    joiner = solo_engine()
    joiner.load_dense_state(veteran.dense_state())
    for key in veteran.held_experts():
        joiner.load_expert_state(key, veteran.expert_state(key))
    assert joiner.step(3).loss == veteran.step(3).loss
    assert joiner.step(4).loss == veteran.step(4).loss


def test_loads_count_every_routed_assignment_once_per_completed_step():
    engine = solo_engine()
    for s in range(2):
        engine.step(s)
    loads = engine.take_loads()
    assert loads.shape == (L, E)
    assert (loads.sum(1) == 2 * CFG.data.global_batch * CFG.model.seq_len * CFG.model.top_k).all()
    assert engine.take_loads().sum() == 0


def test_a_plan_for_another_model_is_refused():
    plan = plan_job([NodeSpec("solo", gpus=1, slots_per_gpu=E + 2)], experts=E + 2, layers=L,
                    min_replicas=1)
    with pytest.raises(ValueError, match="experts: the plan has 6 experts, the model 4"):
        Engine(CFG, plan, 0, Collectives.single())


def test_training_through_the_interpreted_kernels_matches_the_torch_path(monkeypatch):
    # On a GPU training runs the Triton kernels; the interpreter runs the same kernels here.
    torch_path = solo_engine()
    reference = [torch_path.step(s).loss for s in range(2)]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from lazarus_runtime.kernels.backend import interpreting
    assert interpreting()
    engine = solo_engine()
    assert [engine.step(s).loss for s in range(2)] == pytest.approx(reference, abs=1e-5)
