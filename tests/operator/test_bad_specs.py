"""Invalid LazarusJobs: refused at admission by the schema or CEL, or, for what a schema
cannot check, given a condition naming the field, once, with no retry storm: the requests
the operator makes are counted on the wire (testcluster.api_counter) and bounded."""
import time

import pytest
from kubernetes import client
from lazarus_core.job_spec import SpecError, parse_manifest
from lazarus_operator.apply import MAX_STARTING_PODS

import bad_specs
from bad_specs import ADMISSION, CONDITION
from jobkit import make_job, settle
from testcluster.api_counter import ApiCounter
from testcluster.waits import wait_until

pytestmark = pytest.mark.cluster


# A job is marked this soon after it is created, or refused at once (issue 16).
CONDITION_WITHIN_S = 5.0
# What a bad job may cost: kopf reads it, records its handler's outcome and writes the
# condition (status) in a few patches; nothing else is ever asked about it.
MAX_REQUESTS_PER_BAD_JOB = 4


@pytest.fixture
def counted_operator(cluster, operator_factory, tmp_path):
    """An operator whose every request to the API server goes through a counter."""
    counter = ApiCounter(cluster.kubeconfig).start()
    op = operator_factory(kubeconfig=counter.kubeconfig(tmp_path)).start()
    yield op, counter
    op.stop()
    counter.stop()


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


def test_every_bad_spec_is_refused_or_marked_within_5_s_at_a_bounded_cost(counted_operator, jobs,
                                                                        namespace):
    """The whole shared table against the real API server and operator at once."""
    op, counter = counted_operator
    created: dict[str, tuple[bad_specs.BadSpec, float]] = {}
    refused = []
    for i, case in enumerate(bad_specs.CASES):
        manifest = case.apply(make_job(f"bad-{i}", namespace))
        try:
            jobs.create(manifest)
        except client.ApiException as e:
            assert e.status == 422 and case.where != CONDITION, (case.id, e.body)
            refused.append(case.id)
            continue
        assert case.where != ADMISSION, f"{case.id}: the API server accepted it"
        created[manifest["metadata"]["name"]] = (case, time.monotonic())
    assert len(refused) + len(created) >= 20

    latency = {}
    for name, (case, at) in created.items():
        cond = wait_until(lambda name=name: (c := jobs.condition(name, "Ready")) and c,
                          timeout=CONDITION_WITHIN_S + 10, what=f"the condition of {case.id}")
        latency[case.id] = seen = time.monotonic() - at
        assert cond["status"] == "False" and cond["reason"] == case.reason, (case.id, cond)
        assert case.field in cond["message"], (case.id, cond["message"])
        assert seen <= CONDITION_WITHIN_S, f"{case.id}: its condition came after {seen:.1f} s"

    quiet_from = time.monotonic()
    settle(5)
    for name, (case, _) in created.items():
        asked = counter.requests(lambda r, name=name: f"/lazarusjobs/{name}" in r.path
                                 and not r.watch)
        assert 1 <= len(asked) <= MAX_REQUESTS_PER_BAD_JOB, (case.id, asked)
        # Not one more request once the condition is written: no retries in a loop.
        assert not [r for r in asked if r.at >= quiet_from], (case.id, asked)
    # Nothing was made for any of them: no pod, Service, ConfigMap, Secret or Role.
    made = counter.requests(lambda r: r.method == "POST" and f"/namespaces/{namespace}/" in r.path
                            and not r.path.endswith("/events"))
    assert made == [], made
    events = counter.requests(lambda r: r.method == "POST" and r.path.endswith("/events"))
    assert len(events) <= len(created), events
    per_job = [len(counter.requests(lambda r, n=n: f"/lazarusjobs/{n}" in r.path and not r.watch))
               for n in created]
    print(f"\n{len(refused)} refused at admission; {len(created)} marked, the slowest in "
          f"{max(latency.values()):.2f} s; requests per marked job: {min(per_job)}-{max(per_job)}"
          f", Events: {len(events)}")


def test_a_job_far_below_its_target_adds_pods_as_they_start_not_all_at_once(
        counted_operator, jobs, namespace, scratch_nodes):
    """maxNodes 10000 and no replicas: the target is 10,000 workers, on 2 nodes. The operator
    keeps at most MAX_STARTING_PODS of them pending (what a cluster autoscaler needs to see)
    and never creates 10,000 pods in a pass."""
    op, counter = counted_operator
    scratch_nodes("gpu-spot", num_zones=1, nodes_per_zone=2)
    job = make_job("huge", namespace, maxNodes=10000, minNodes=2,
                   runtime={"globalBatch": 10000})
    assert "replicas" not in job["spec"]  # absent: the target is maxNodes
    jobs.create(job)
    wait_until(lambda: len(jobs.workers("huge")) >= 2 + MAX_STARTING_PODS // 2, timeout=60,
               what="the job's first batches of pods")
    settle(5)
    pods = jobs.workers("huge")
    assert 2 + MAX_STARTING_PODS // 2 <= len(pods) <= 2 + MAX_STARTING_PODS
    creates = counter.requests(lambda r: r.method == "POST" and r.path.endswith(
        f"/namespaces/{namespace}/pods"))
    assert len(creates) <= 1 + 2 + MAX_STARTING_PODS  # the coordinator, two running, the rest
