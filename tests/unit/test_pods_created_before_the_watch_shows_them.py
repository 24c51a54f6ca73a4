"""Worker pods a pass created count as starting until the watch shows them: on a loaded
control plane the next pass's observation can predate them, and it used to send the same
creations again (each answered 409)."""
from types import SimpleNamespace

import pytest
from kubernetes import client

from lazarus_core import controller as c
from lazarus_core.job_spec import parse_spec
from lazarus_operator import apply as apply_module
from lazarus_operator.apply import UNSEEN_FOR_S, Applier, JobRecord
from lazarus_operator.observe import Observation

BODY = {"metadata": {"namespace": "ns", "name": "j", "uid": "uid-j", "generation": 1}}
SPEC = parse_spec({"runtime": {"experts": 4, "layers": 2, "globalBatch": 40}, "minNodes": 2,
                   "maxNodes": 10,
                   "slotsPerGpu": 4})


class Pods:
    """create_namespaced_pod as the API server answers it: 409 for a name it holds."""

    def __init__(self):
        self.posts, self.held = [], set()

    def create_namespaced_pod(self, namespace, body):
        name = body["metadata"]["name"]
        self.posts.append(name)
        if name in self.held:
            raise client.ApiException(status=409, reason="AlreadyExists")
        self.held.add(name)

    def read_namespaced_pod(self, name, namespace):
        return SimpleNamespace(metadata=SimpleNamespace(
            owner_references=[SimpleNamespace(kind="LazarusJob", name="j", uid="uid-j")]))


def _applier(pods: Pods) -> Applier:
    api = SimpleNamespace(api_client=client.ApiClient(),
                          create_namespaced_pod=pods.create_namespaced_pod,
                          read_namespaced_pod=pods.read_namespaced_pod)
    return Applier(api, None, None, clock=lambda: 0.0, coordinator_port=1)


def _seen(names) -> Observation:
    """An observation that shows ``names`` as starting pods."""
    return Observation(starting=list(names),
                       used_indices={int(n.rsplit("-", 1)[-1]) for n in names})


@pytest.fixture
def job(monkeypatch):
    """(the API's pods, the job's record, a pass over an observation, the clock)."""
    pods, record, state, now = Pods(), JobRecord(key_secret="key"), c.new_job(SPEC), [100.0]
    monkeypatch.setattr(apply_module.time, "monotonic", lambda: now[0])
    applier = _applier(pods)

    def right_size(obs):
        applier._right_size(record, BODY, SPEC, state, obs, lambda: False)

    return pods, record, right_size, now


def test_a_pass_on_a_stale_view_does_not_create_the_same_pods_again(job):
    pods, record, right_size, _ = job
    right_size(Observation())
    created = list(pods.posts)
    assert len(created) == SPEC.target_nodes == 10
    # The watch has shown none of them yet: nothing is sent again.
    right_size(Observation())
    assert pods.posts == created
    # Four shown: still nothing to create; the six others still count as starting.
    right_size(_seen(created[:4]))
    assert pods.posts == created and len(record.unseen) == 6
    # All shown: nothing unseen left.
    right_size(_seen(created))
    assert pods.posts == created and record.unseen == {}


def test_a_pod_never_shown_is_taken_as_gone_after_a_while(job):
    pods, _, right_size, now = job
    right_size(Observation())
    first = list(pods.posts)
    shown = first[:7]  # three were deleted before the watch saw them
    now[0] += UNSEEN_FOR_S - 1
    right_size(_seen(shown))
    assert pods.posts == first
    now[0] += 2
    right_size(_seen(shown))
    again = pods.posts[len(first):]
    assert len(again) == 3 and not set(again) & set(shown)
