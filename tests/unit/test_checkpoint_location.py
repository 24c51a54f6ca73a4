"""spec.checkpoint: which paths the workers can share, keep and secretName, and that the
parser and the CRD agree on them."""
from pathlib import Path

import pytest
import yaml

from checkpoint_paths import ACCEPTED, REFUSED
from lazarus_core.checkpoint_location import (KEEP_DEFAULT, KEEP_MAX, KEEP_MIN, SCHEMES,
                                              job_root, path_problem)
from lazarus_core.job_spec import SpecError, parse_spec

ROOT = Path(__file__).resolve().parents[2]


def spec(**checkpoint):
    return {"runtime": {"experts": 4, "layers": 2}, "minNodes": 2, "maxNodes": 4,
            "slotsPerGpu": 4, "checkpoint": checkpoint}


def crd_checkpoint() -> dict:
    crd = yaml.safe_load((ROOT / "crds" / "lazarusjob.yaml").read_text())
    props = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return props["properties"]["checkpoint"]


@pytest.mark.parametrize("path", ACCEPTED)
def test_shared_locations_are_accepted(path):
    assert path_problem(path) is None
    assert parse_spec(spec(path=path)).checkpoint.path == path


@pytest.mark.parametrize("path, word", REFUSED)
def test_locations_workers_cannot_share_are_refused_with_the_fix(path, word):
    assert word in path_problem(path)
    with pytest.raises(SpecError) as e:
        parse_spec(spec(path=path))
    [v] = e.value.violations
    assert (v.field, v.reason) == ("spec.checkpoint.path", "InvalidCheckpoint")


def test_keep_and_secret_name_are_read_and_bounded():
    ck = parse_spec(spec(path="s3://bucket/x", keep=5, secretName="ckpt-creds")).checkpoint
    assert (ck.keep, ck.secret_name) == (5, "ckpt-creds")
    ck = parse_spec(spec(path="/data")).checkpoint
    assert (ck.keep, ck.secret_name) == (KEEP_DEFAULT, None)
    for bad, field in (({"keep": 0}, "spec.checkpoint.keep"),
                       ({"keep": KEEP_MAX + 1}, "spec.checkpoint.keep"),
                       ({"secretName": "Not_A_Name"}, "spec.checkpoint.secretName"),
                       ({"secretName": ""}, "spec.checkpoint.secretName")):
        with pytest.raises(SpecError) as e:
            parse_spec(spec(path="/data", **bad))
        assert [v.field for v in e.value.violations] == [field], bad


def test_the_crd_has_the_parsers_keep_bounds_and_schemes():
    props = crd_checkpoint()["properties"]
    assert (props["keep"]["default"], props["keep"]["minimum"], props["keep"]["maximum"]) == (
        KEEP_DEFAULT, KEEP_MIN, KEEP_MAX)
    scheme_rule = props["path"]["x-kubernetes-validations"][0]["rule"]
    for scheme in SCHEMES:
        assert f"{scheme}:" in scheme_rule or f"|{scheme})" in scheme_rule or \
            f"({scheme}|" in scheme_rule, scheme


def test_each_job_writes_under_its_own_uid():
    assert job_root("s3://b/ckpt/", "0f3c-11") == "s3://b/ckpt/0f3c-11"
    assert job_root("/data", "uid") == "/data/uid"
    with pytest.raises(ValueError):
        job_root("/data", "../other-job")
