"""The manifest's spec.runtime section becomes typed configs, or an error naming the field."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lazarus_core.runtime_config import NAMED_MODELS, RuntimeConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_named_model_with_overrides():
    cfg = RuntimeConfig.from_manifest({"model": "gpt-s", "topK": 2, "seqLen": 256,
                                       "learningRate": "3e-4", "globalBatch": 16})
    assert cfg.model.experts == 8 and cfg.model.top_k == 2 and cfg.model.seq_len == 256
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.data.global_batch == 16 and cfg.data.source == "generated"


def test_compute_options():
    cfg = RuntimeConfig.from_manifest({"precision": "bf16", "activationCheckpointing": "full",
                                       "compile": "dense"})
    assert (cfg.compute.precision, cfg.compute.activation_checkpointing,
            cfg.compute.compile) == ("bf16", "full", "dense")
    defaults = RuntimeConfig.from_manifest({}).compute
    assert (defaults.precision, defaults.activation_checkpointing, defaults.compile) == \
        (None, "none", "none")


def test_paper_models_have_the_paper_sizes():
    # Parameter counts from paper-notes.md: 521M, 1.3B, 1.7B (every FFN an MoE layer).
    def params(m):
        attention_and_gate = 4 * m.dim * m.dim + m.dim * m.experts
        dense = m.vocab * m.dim + m.seq_len * m.dim + m.layers * attention_and_gate
        experts = m.layers * m.experts * 2 * m.dim * m.ffn_dim
        return dense + experts
    assert params(NAMED_MODELS["gpt-s"]) == pytest.approx(521e6, rel=0.02)
    assert params(NAMED_MODELS["gpt-m"]) == pytest.approx(1.3e9, rel=0.03)
    assert params(NAMED_MODELS["gpt-l"]) == pytest.approx(1.7e9, rel=0.03)


@pytest.mark.parametrize("runtime, field", [
    ({"model": "gpt-xl"}, "model"),
    ({"topK": 3}, "topK"),
    ({"experts": 1, "topK": 2}, "topK"),
    ({"heads": 3}, "heads"),
    ({"layers": 0}, "layers"),
    ({"ffnDim": "64"}, "ffnDim"),
    ({"globalBatch": True}, "globalBatch"),
    ({"learningRate": "fast"}, "learningRate"),
    ({"learningRate": "-1"}, "learningRate"),
    ({"beta2": "1"}, "beta2"),
    ({"dataset": ""}, "dataset"),
    ({"topk": 2}, "topk"),
    ({"precision": "fp16"}, "precision"),
    ({"activationCheckpointing": True}, "activationCheckpointing"),
    ({"compile": "all"}, "compile"),
])
def test_bad_values_name_their_field(runtime, field):
    with pytest.raises(ValueError, match=rf"^(runtime: unknown field\(s\) )?{field}"):
        RuntimeConfig.from_manifest(runtime)


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_manifests_configure_the_runtime(path):
    runtime = yaml.safe_load(path.read_text())["spec"]["runtime"]
    cfg = RuntimeConfig.from_manifest(runtime)
    assert (cfg.model.experts, cfg.model.layers) == (runtime["experts"], runtime["layers"])
