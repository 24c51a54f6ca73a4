"""Node changes that come while a pass is under way: the pass leaves its decisions to the
pass they asked for (once in a row at most), and one that acts all the same leaves the pods
to delete and create, and the status, to that pass; the pass that re-plans for them does
not also relist; and a relist of the nodes that began before a node's deletion reached the
watch does not bring the node back."""
import json
import threading
from types import SimpleNamespace

from kubernetes import client

from lazarus_core import controller as c
from lazarus_core.job_spec import parse_spec
from lazarus_operator import builders
from lazarus_operator.apply import Applier, JobRecord
from lazarus_operator.cluster_cache import ClusterCache
from lazarus_operator.job_queue import JobQueue
from lazarus_operator.observe import NodeInfo, Observation
from lazarus_operator.reconciler import Reconciler

KEY = ("ns", "j")
UID = "uid-j"
BODY = {"metadata": {"namespace": "ns", "name": "j", "uid": UID, "generation": 1}}
SPEC = parse_spec({"runtime": {"experts": 4, "layers": 2}, "minNodes": 2, "maxNodes": 4,
                   "slotsPerGpu": 4})


def _worker(node, index, phase="Running"):
    return {"metadata": {"name": f"j-worker-{index}", "uid": f"uid-{index}",
                         "labels": {builders.INDEX_LABEL: str(index)},
                         "ownerReferences": [{"kind": "LazarusJob", "name": "j", "uid": UID}]},
            "spec": {"nodeName": node}, "status": {"phase": phase}}


def _node(name):
    return {"metadata": {"name": name},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


class FakeCache:
    """The job's workers on ``nodes``; ``after_look`` runs once a pass has looked at their
    nodes (a node event that comes while it thinks)."""

    def __init__(self, nodes):
        self.workers = [_worker(n, i) for i, n in enumerate(nodes)]
        self.infos = {n: NodeInfo(n, "a", True, True, frozenset()) for n in nodes}
        self.after_look = lambda: None
        self.relists = []  # per pass: whether it listed the pods afresh

    def pods(self, key, role, full):
        if role == "worker":
            self.relists.append(full)
            return list(self.workers)
        return []

    def refresh_nodes(self, pods):
        pass

    def state(self, key, uid, full):
        return {}

    def node_infos(self, pods):
        infos = {p["spec"]["nodeName"]: self.infos.get(p["spec"]["nodeName"]) for p in pods}
        then, self.after_look = self.after_look, lambda: None
        then()
        return infos


def _reconciler(nodes):
    """A reconciler over a fake cache whose applied decisions are recorded, and whose
    queue records the passes asked for instead of running them."""
    r = Reconciler(client.ApiClient(), c.Settings(start_grace_s=0))
    r.cache = FakeCache(nodes)
    asked = threading.Event()
    r.queue = JobQueue(lambda namespace, name: asked.set())
    applied = []
    # ``told``: whether each pass that acted told its applier it was overtaken.
    r.applier = SimpleNamespace(told=[], apply=lambda record, body, spec, before, outcome, *args:
                                (applied.append(outcome), r.applier.told.append(args[-1]())))
    return r, applied, asked


def _plans(outcomes):
    return [sorted(n.name for n in d.plan.nodes) for o in outcomes for d in o.decisions
            if isinstance(d, c.PublishPlan)]


def _run(r, record):
    r._pass(record, KEY, BODY, SPEC, 0.0)


def _lose(r, node):
    """A node event as the handler delivers it: the cache, then the settling window."""
    del r.cache.infos[node]
    r.request_settled(*KEY)


def test_a_pass_that_a_node_loss_overtook_publishes_nothing_and_the_next_one_does():
    r, applied, asked = _reconciler(["n0", "n1", "n2", "n3"])
    record = r._record(KEY)
    record.state = c.new_job(SPEC, r.settings)
    _run(r, record)
    assert _plans(applied) == [["n0", "n1", "n2", "n3"]]
    first = record.state

    r.cache.after_look = lambda: _lose(r, "n1")
    _run(r, record)
    assert len(applied) == 1 and record.state is first  # nothing decided, nothing applied
    assert asked.wait(5), "the node change asked for no pass"

    _run(r, record)
    assert _plans(applied)[-1] == ["n0", "n2", "n3"]


def test_node_changes_during_every_pass_cannot_hold_back_every_other_one():
    r, applied, _ = _reconciler(["n0", "n1", "n2", "n3"])
    record = r._record(KEY)
    record.state = c.new_job(SPEC, r.settings)
    _run(r, record)
    for lost in ("n1", "n2"):
        r.cache.after_look = lambda lost=lost: _lose(r, lost)
        _run(r, record)
    # The first pass left its decisions to the second, which published what it had seen;
    # the pass those changes asked for is due, so its applier leaves the pods to that one.
    assert _plans(applied) == [["n0", "n1", "n2", "n3"], ["n0", "n2", "n3"]]
    assert r.applier.told == [False, True]


def test_a_pass_that_leaves_its_decisions_to_the_next_leaves_its_failures_too():
    r, applied, _ = _reconciler(["n0", "n1", "n2", "n3"])
    record = r._record(KEY)
    record.state = c.new_job(SPEC, r.settings)
    _run(r, record)
    r.cache.workers[3] = _worker("n3", 3, phase="Failed")
    r.cache.after_look = lambda: _lose(r, "n1")
    _run(r, record)
    assert record.failures_seen == set()  # not told: the next pass tells it
    _run(r, record)
    assert record.failures_seen == {"uid-3"}
    assert _plans(applied)[-1] == ["n0", "n2"]


def test_the_pass_that_re_plans_for_node_changes_leaves_the_heartbeats_relist_to_the_next():
    r, applied, _ = _reconciler(["n0", "n1", "n2", "n3"])
    record = r._record(KEY)
    record.state = c.new_job(SPEC, r.settings)
    _run(r, record)
    r._mark_relist(KEY)
    _lose(r, "n1")
    _run(r, record)  # training waits for this one's plan
    assert _plans(applied)[-1] == ["n0", "n2", "n3"]
    _lose(r, "n2")
    _run(r, record)  # node changes again, but the relist has waited once already
    assert r.cache.relists == [False, False, True]


def test_a_relist_of_the_nodes_does_not_undo_a_deletion_the_watch_delivered_meanwhile():
    nodes = {n: _node(n) for n in ("n0", "n1", "n2")}
    cache = ClusterCache(None)

    def list_node(**_):
        page = [nodes[n] for n in sorted(nodes)]  # read before the deletion reached the watch
        cache.node_changed(None, "n1")
        return SimpleNamespace(data=json.dumps({"items": page, "metadata": {}}))

    def list_namespaced_pod(namespace, **_):
        return SimpleNamespace(data=json.dumps({"items": [
            _worker(n, i) for i, n in enumerate(nodes)], "metadata": {}}))

    cache.core = SimpleNamespace(list_node=list_node, list_namespaced_pod=list_namespaced_pod)
    for n in nodes:
        cache.node_changed(nodes[n], n)
    cache.refresh_nodes(cache.pods(KEY, "worker", full=True))
    assert "n1" in cache.gone and "n1" not in cache.nodes
    assert set(cache.nodes) == {"n0", "n2"}


class FakePods:
    """Pod creation that records each name, and a pass overtaken once ``overtake_after``
    pods were asked for."""

    def __init__(self, overtake_after):
        self.created = []
        self.overtake_after = overtake_after

    def create_namespaced_pod(self, namespace, pod):
        self.created.append(pod["metadata"]["name"])

    def read_namespaced_pod(self, name, namespace):
        raise AssertionError("only a name already taken is read")

    def overtaken(self):
        return len(self.created) >= self.overtake_after


def _right_size(pods):
    applier = Applier(client.CoreV1Api(client.ApiClient()), None, None, lambda: 0.0, 2379)
    applier.core = pods
    state = c.new_job(SPEC, c.Settings(start_grace_s=0))
    applier._right_size(JobRecord(key_secret="key"), BODY, SPEC, state, Observation(),
                        pods.overtaken)
    return pods.created


def test_an_overtaken_pass_creates_no_further_batch_of_workers():
    # Four workers missing: batches of 1, 2 and 1. Overtaken after the first, the pass
    # stops there; the next pass creates the rest (it right-sizes from what it sees).
    assert len(_right_size(FakePods(overtake_after=10))) == SPEC.target_nodes == 4
    assert _right_size(FakePods(overtake_after=1)) == ["j-worker-0"]


class TailApplier(Applier):
    """An applier whose calls to the API server are recorded, not made."""

    def __init__(self):
        super().__init__(client.CoreV1Api(client.ApiClient()), None, None, lambda: 0.0, 2379)
        self.calls = []
        self.core = SimpleNamespace(delete_namespaced_pod=lambda name, namespace, **_:
                                    self.calls.append(("delete", name)))

    def _ensure_job_objects(self, record, body):
        pass

    def _keep_coordinator(self, *args):
        pass

    def _right_size(self, *args):
        self.calls.append(("right-size",))

    def _patch_status(self, body, state):
        self.calls.append(("status",))


def test_an_overtaken_pass_leaves_the_pods_and_status_to_the_pass_that_is_due():
    # Deleting a reclaim's stranded pods, creating their replacements and patching the
    # status took 8.7 s on a loaded control plane; the pass that node changes asked for
    # redoes all three from what it sees, and training waits for its plan.
    # Never twice in a row: node changes that never stop must not keep a job from its pods.
    state = c.new_job(SPEC, c.Settings(start_grace_s=0))
    obs = Observation(doomed=[("j-worker-1", True)])
    record, applier = JobRecord(), TailApplier()
    tail = [("delete", "j-worker-1"), ("right-size",), ("status",)]
    for overtaken, calls in ((False, tail), (True, []), (True, tail), (True, [])):
        applier.calls = []
        applier.apply(record, BODY, SPEC, state, c.Outcome(state), obs, None, 0.0, "",
                      lambda: overtaken)
        assert applier.calls == calls
