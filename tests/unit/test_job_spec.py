"""The LazarusJob spec parser: what the local backend and the operator accept and reject."""
from pathlib import Path

import pytest
import yaml

import bad_specs

from lazarus_core.job_spec import (
    DEFAULT_SPOT_NOTICE_TAINTS,
    DEFAULTS,
    SpecError,
    parse_manifest,
    parse_spec,
)

ROOT = Path(__file__).resolve().parents[2]


def spec(**overrides):
    base = {
        "runtime": {"model": "tiny", "experts": 4, "layers": 2, "topK": 2},
        "minNodes": 2, "maxNodes": 4, "gpusPerNode": 1, "slotsPerGpu": 2, "minReplicas": 2,
    }
    base.update(overrides)
    return base


def test_defaults_fill_what_the_manifest_leaves_out():
    s = parse_spec(spec())
    assert s.replicas == 4  # desired nodes default to maxNodes
    assert s.policy == "mro"
    assert s.rebalance_every_steps == 200
    assert s.spot_notice_taints == DEFAULT_SPOT_NOTICE_TAINTS
    assert s.checkpoint is None
    assert s.runtime["model"] == "tiny"  # free-form runtime args are kept as given


def test_fewest_nodes_covers_the_replicas_f_needs():
    # 4 experts x 2 replicas need 8 slots: 4 nodes of 2 slots, although minNodes is 1.
    s = parse_spec(spec(minNodes=1, maxNodes=6))
    assert s.fewest_nodes == 4


@pytest.mark.parametrize("overrides, field, reason", [
    ({"minNodes": 5}, "spec.minNodes", "InvalidNodeRange"),
    ({"maxNodes": 3, "minNodes": 1, "minReplicas": 2, "slotsPerGpu": 1}, "spec.maxNodes",
     "InsufficientSlots"),
    ({"placement": "random"}, "spec.placement", "InvalidPlacement"),
    ({"replicas": 9}, "spec.replicas", "InvalidNodeRange"),
    ({"minReplicas": 0}, "spec.minReplicas", "InvalidField"),
    ({"gpusPerNode": 1.5}, "spec.gpusPerNode", "InvalidField"),
    ({"steps": 0}, "spec.steps", "InvalidField"),
    ({"steps": "100"}, "spec.steps", "InvalidField"),
    ({"coordinator": ["cpu"]}, "spec.coordinator", "InvalidCoordinator"),
    ({"runtime": {"experts": 4}}, "spec.runtime.layers", "MissingField"),
    ({"runtime": {"experts": 2, "layers": 1, "topK": 3}}, "spec.runtime.topK", "InvalidRuntime"),
    ({"checkpoint": {"path": "relative/dir", "everySteps": 10}}, "spec.checkpoint.path",
     "InvalidCheckpoint"),
    ({"checkpoint": {"path": "/ckpt", "everySteps": 0}}, "spec.checkpoint.everySteps",
     "InvalidField"),
    ({"spotNoticeTaints": [{"key": "a"}, {"key": "a"}]}, "spec.spotNoticeTaints",
     "InvalidSpotNoticeTaints"),
    ({"template": {"resources": {"limits": {"nvidia.com/gpu": 2}}}},
     "spec.template.resources.limits[nvidia.com/gpu]", "GpuRequestMismatch"),
])
def test_each_bad_spec_names_its_field(overrides, field, reason):
    with pytest.raises(SpecError) as e:
        parse_spec(spec(**overrides))
    assert field in [v.field for v in e.value.violations], e.value
    assert reason in [v.reason for v in e.value.violations]
    assert field in str(e.value)


def test_every_violation_is_reported_at_once():
    with pytest.raises(SpecError) as e:
        parse_spec(spec(minNodes=0, placement="x", runtime={}))
    fields = {v.field for v in e.value.violations}
    assert {"spec.minNodes", "spec.placement", "spec.runtime.experts",
            "spec.runtime.layers"} <= fields


def test_manifest_needs_the_right_kind_and_a_short_dns_name():
    doc = {"apiVersion": "lazarus.dev/v1alpha1", "kind": "LazarusJob",
           "metadata": {"name": "Bad_Name"}, "spec": spec()}
    with pytest.raises(SpecError) as e:
        parse_manifest(doc)
    assert e.value.violations[0].field == "metadata.name"
    doc["metadata"]["name"] = "ok"
    assert parse_manifest(doc)[0] == "ok"


def test_parser_defaults_equal_the_crd_defaults():
    crd = yaml.safe_load((ROOT / "crds" / "lazarusjob.yaml").read_text())
    props = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    for key in ("gpusPerNode", "slotsPerGpu", "minReplicas", "placement",
                "rebalanceEverySteps", "rebalanceMinGainPercent", "movePricePercent"):
        assert props[key]["default"] == DEFAULTS[key], key
    assert props["checkpoint"]["properties"]["everySteps"]["default"] == DEFAULTS["checkpointEverySteps"]
    assert tuple(t["key"] for t in props["spotNoticeTaints"]["default"]) == DEFAULT_SPOT_NOTICE_TAINTS


def test_every_example_parses():
    examples = sorted((ROOT / "examples").glob("*.yaml"))
    assert any("tiny" in p.name for p in examples)
    for path in examples:
        parse_manifest(yaml.safe_load(path.read_text()))


def test_every_example_is_a_runtime_config_the_workers_accept():
    # The operator keeps spec.runtime free-form; the workers' parser must accept what we ship.
    config = pytest.importorskip("lazarus_core.runtime_config")
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        _, spec = parse_manifest(yaml.safe_load(path.read_text()))
        model = config.RuntimeConfig.from_manifest(dict(spec.runtime)).model
        assert (model.experts, model.layers) == (spec.experts, spec.layers), path.name


def _valid_manifest() -> dict:
    return {"apiVersion": "lazarus.dev/v1alpha1", "kind": "LazarusJob",
            "metadata": {"name": "ok"}, "spec": spec(slotsPerGpu=4)}


@pytest.mark.parametrize("case", bad_specs.params())
def test_the_parser_refuses_every_bad_spec_of_the_shared_table(case):
    """The same table the API server and the operator are held to (tests/bad_specs.py)."""
    parse_manifest(_valid_manifest())
    with pytest.raises(SpecError) as e:
        parse_manifest(case.apply(_valid_manifest()))
    named = [v for v in e.value.violations if v.field.startswith(case.field)]
    assert named, f"{case.id}: {e.value}"
    if case.reason:
        assert case.reason in {v.reason for v in named}, e.value


def _crd_schema() -> dict:
    crd = yaml.safe_load((ROOT / "crds" / "lazarusjob.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_parser_bounds_and_patterns_equal_the_crds():
    from lazarus_core import job_spec, quantity, runtime_config

    schema = _crd_schema()
    props = schema["properties"]["spec"]["properties"]
    for key, (low, high) in job_spec.LIMITS.items():
        assert (props[key]["minimum"], props[key]["maximum"]) == (low, high), key
    runtime = props["runtime"]["properties"]
    keys = {"layers": "layers", "dim": "dim", "heads": "heads", "experts": "experts",
            "ffn_dim": "ffnDim", "vocab": "vocab", "seq_len": "seqLen"}
    for name, high in runtime_config.MODEL_LIMITS.items():
        assert (runtime[keys[name]]["minimum"], runtime[keys[name]]["maximum"]) == (1, high), name
    assert runtime["seed"]["maximum"] == runtime["dataSeed"]["maximum"] == runtime_config.MAX_SEED
    assert runtime["globalBatch"]["maximum"] == runtime_config.MAX_GLOBAL_BATCH
    assert runtime["generatedTokens"]["maximum"] == runtime_config.MAX_GENERATED_TOKENS
    assert set(runtime["model"]["enum"]) == set(runtime_config.NAMED_MODELS)
    for knob in ("learningRate", "weightDecay", "beta1", "beta2"):
        assert runtime[knob]["pattern"] == runtime_config._DECIMAL.pattern, knob
    for section in ("template", "coordinator"):
        amounts = props[section]["properties"]["resources"]["additionalProperties"]
        assert amounts["additionalProperties"]["pattern"] == quantity.PATTERN, section
    name = schema["properties"]["metadata"]["properties"]["name"]
    assert name["maxLength"] == job_spec.MAX_NAME_LENGTH


def test_the_runtime_section_is_checked_by_the_workers_own_parser():
    # A runtime the workers would refuse is refused here, with the field the workers name.
    with pytest.raises(SpecError) as e:
        parse_spec(spec(runtime={"experts": 4, "layers": 2, "learningRate": "abc",
                                 "model": "tiny"}))
    assert [v.field for v in e.value.violations] == ["spec.runtime.learningRate"]
    # experts and layers are required by the spec even though the named model has them.
    with pytest.raises(SpecError) as e:
        parse_spec(spec(runtime={"model": "gpt-s"}))
    assert {v.field for v in e.value.violations} == {"spec.runtime.experts",
                                                     "spec.runtime.layers"}


def test_a_paper_model_on_its_paper_node_fits_and_a_huge_one_does_not():
    gpt_l = {"model": "gpt-l", "experts": 16, "layers": 12, "globalBatch": 64}
    assert parse_spec(spec(runtime=gpt_l, gpusPerNode=8, slotsPerGpu=6, maxNodes=4,
                           minNodes=2, minReplicas=2)).experts == 16
    wide = gpt_l | {"ffnDim": 262144}
    with pytest.raises(SpecError) as e:
        parse_spec(spec(runtime=wide, gpusPerNode=8, slotsPerGpu=6, maxNodes=4, minNodes=2))
    assert e.value.reason == "ModelTooLarge" and "288 GiB" in str(e.value)
