"""spec.checkpoint at admission: the API server's CEL rules accept and refuse the same paths
as the parser (tests/checkpoint_paths.py), so a path no worker can share never reaches the
operator, and keep and secretName are bounded by the schema."""
import pytest
from kubernetes import client

from checkpoint_paths import ACCEPTED, REFUSED
from jobkit import make_job

pytestmark = pytest.mark.cluster


def test_the_api_server_accepts_and_refuses_what_the_parser_does(jobs, lazarus_crds):
    refused = {}
    for i, path in enumerate([*ACCEPTED, *(p for p, _ in REFUSED)]):
        try:
            jobs.create(make_job(f"ck-{i}", jobs.namespace, checkpoint={"path": path}))
        except client.ApiException as e:
            assert e.status == 422, e.body
            assert "spec.checkpoint.path" in e.body, e.body
            refused[path] = e.body
    assert sorted(refused) == sorted(p for p, _ in REFUSED), (
        f"accepted but should not be: {sorted({p for p, _ in REFUSED} - set(refused))}; "
        f"refused but should not be: {sorted(set(refused) & set(ACCEPTED))}")


@pytest.mark.parametrize("checkpoint, field", [
    ({"keep": 0}, "spec.checkpoint.keep"),
    ({"keep": 101}, "spec.checkpoint.keep"),
    ({"secretName": "Bad_Name"}, "spec.checkpoint.secretName"),
])
def test_keep_and_secret_name_are_bounded_at_admission(jobs, lazarus_crds, checkpoint, field):
    with pytest.raises(client.ApiException) as e:
        jobs.create(make_job("bad-ck", jobs.namespace, checkpoint=checkpoint))
    assert e.value.status == 422 and field in e.value.body, e.value.body


def test_keep_defaults_to_three(jobs, lazarus_crds):
    jobs.create(make_job("default-keep", jobs.namespace))
    assert jobs.get("default-keep")["spec"]["checkpoint"]["keep"] == 3
