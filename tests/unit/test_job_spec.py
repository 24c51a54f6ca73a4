"""The LazarusJob spec parser: what the local backend and the operator accept and reject."""
from pathlib import Path

import pytest
import yaml

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
                "rebalanceEverySteps", "rebalanceMinGainPercent"):
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
