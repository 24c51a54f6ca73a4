"""Invalid LazarusJobs: refused at admission by the schema or CEL, or, for what a schema
cannot check, given a condition naming the field, once, with no retry storm."""
import pytest
from kubernetes import client
from lazarus_core.job_spec import SpecError, parse_manifest

import bad_specs
from bad_specs import ADMISSION, CONDITION
from jobkit import make_job, settle
from testcluster.waits import wait_until

pytestmark = pytest.mark.cluster


def _admitted(jobs, manifest: dict) -> tuple[bool, str]:
    """Whether the API server stores the job (it is deleted again), or why it refused it."""
    try:
        jobs.create(manifest)
    except client.ApiException as e:
        assert e.status == 422, e.body  # refused by the schema or CEL, not malformed
        return False, e.body
    jobs.custom.delete_namespaced_custom_object(
        "lazarus.dev", "v1alpha1", jobs.namespace, "lazarusjobs", manifest["metadata"]["name"])
    return True, ""


@pytest.mark.parametrize("case", bad_specs.params())
def test_the_api_server_and_the_parser_agree_on_every_bad_spec(jobs, lazarus_crds, case):
    """The shared table (tests/bad_specs.py): the parser refuses each case, naming the field;
    the API server refuses the admission cases naming the same field and stores the others,
    which the operator then marks with a condition (test_a_bad_spec_gets_its_condition...)."""
    manifest = case.apply(make_job("bad", jobs.namespace))
    with pytest.raises(SpecError) as refused:
        parse_manifest(manifest)
    assert any(v.field.startswith(case.field) for v in refused.value.violations), refused.value
    admitted, why = _admitted(jobs, manifest)
    if case.where == ADMISSION:
        assert not admitted and case.field in why, f"{case.id}: {why}"
    elif case.where == CONDITION:
        assert admitted, f"{case.id}: the API server refused what only the operator can check"


def test_immutable_fields_cannot_change(jobs, lazarus_crds):
    jobs.create(make_job("frozen", jobs.namespace))
    for patch, field in (({"spec": {"slotsPerGpu": 8}}, "spec.gpusPerNode"),
                         ({"spec": {"runtime": {"experts": 8}}}, "spec.runtime.experts")):
        with pytest.raises(client.ApiException) as e:
            jobs.patch("frozen", patch)
        assert e.value.status == 422 and "immutable" in e.value.body and field in e.value.body


def test_a_spec_the_schema_cannot_check_gets_a_condition_once(operator, jobs, namespace):
    # Resource quantities are strings the schema cannot compare with gpusPerNode.
    jobs.create(make_job("mismatch", namespace, gpusPerNode=2,
                         template={"resources": {"limits": {"nvidia.com/gpu": 4}}}))
    cond = wait_until(lambda: (c := jobs.condition("mismatch", "Ready")) and c, timeout=20,
                      what="the Ready condition of the invalid job")
    assert cond["status"] == "False" and cond["reason"] == "GpuRequestMismatch"
    assert "spec.template.resources.limits[nvidia.com/gpu]" in cond["message"]
    assert "gpusPerNode is 2" in cond["message"]
    version = jobs.get("mismatch")["metadata"]["resourceVersion"]
    settle(5)
    # No retry storm: handled once, permanently; nothing created; the job left alone.
    assert operator.log_text().count("GpuRequestMismatch") <= 2
    assert jobs.get("mismatch")["metadata"]["resourceVersion"] == version
    assert jobs.workers("mismatch") == [] and jobs.plan("mismatch") is None
    # Fixing the field makes the job run.
    jobs.patch("mismatch", {"spec": {"template": {"resources": {"limits": {"nvidia.com/gpu": 2}}}}})
    wait_until(lambda: jobs.workers("mismatch"), timeout=20, what="workers after the fix")
