"""Invalid LazarusJobs: refused at admission by the schema or CEL, or, for what a schema
cannot check, given a condition naming the field, once, with no retry storm."""
import pytest
from kubernetes import client

from jobkit import make_job, settle
from testcluster.waits import wait_until

pytestmark = pytest.mark.cluster

# (what is wrong, spec overrides, a field path the API server's message must name)
REJECTED_AT_ADMISSION = [
    ("min above max", {"minNodes": 5, "maxNodes": 4}, "spec.minNodes"),
    ("too few slots for f", {"maxNodes": 2, "minNodes": 1, "slotsPerGpu": 1, "minReplicas": 3},
     "spec.maxNodes"),
    ("unknown placement", {"placement": "random"}, "spec.placement"),
    ("f of zero", {"minReplicas": 0}, "spec.minReplicas"),
    ("a float node count", {"maxNodes": 4.5}, "spec.maxNodes"),
    ("experts missing", {"runtime": {"model": "tiny", "experts": None, "layers": 2}},
     "spec.runtime.experts"),
    ("topK above experts", {"runtime": {"experts": 1, "layers": 2, "topK": 2}},
     "spec.runtime.topK"),
    ("relative checkpoint path", {"checkpoint": {"path": "ckpt/run1"}}, "spec.checkpoint.path"),
    ("replicas beyond maxNodes", {"replicas": 9}, "spec.replicas"),
    ("a string GPU count", {"gpusPerNode": "eight"}, "spec.gpusPerNode"),
    ("no node range", {"minNodes": None}, "spec.minNodes"),
]


def _without_nulls(d):
    return {k: _without_nulls(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}


@pytest.mark.parametrize("what, overrides, field", REJECTED_AT_ADMISSION,
                         ids=[c[0] for c in REJECTED_AT_ADMISSION])
def test_schema_and_cel_reject_with_the_field_named(jobs, lazarus_crds, what, overrides, field):
    job = make_job("bad", jobs.namespace, **overrides)
    job["spec"] = _without_nulls(job["spec"])
    with pytest.raises(client.ApiException) as e:
        jobs.create(job)
    assert e.value.status == 422, e.value.body
    assert field in e.value.body, f"{what}: {e.value.body}"


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
