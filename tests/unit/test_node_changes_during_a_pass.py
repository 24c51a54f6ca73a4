"""Node changes that come while a pass is under way: the pass leaves its decisions to the
pass they asked for (once in a row at most), and one that acts all the same leaves the pods
to delete and create, and the status, to that pass; a re-plan does not wait for the
heartbeat's full list of the job's pods and nodes; and a list that began before a watch
event does not undo it (a deleted node or pod does not come back, a new pod does not go)."""
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
from lazarus_operator.reconciler import RELIST_S, Reconciler

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
        self.listing = threading.Event()  # set: a ``resync`` may finish
        self.listing.set()
        self.resyncs = 0
        self.entered = threading.Event()  # set: a ``resync`` has begun
        self.refused = False

    def pods(self, key, role):
        return list(self.workers) if role == "worker" else []

    def resync(self, key, uid):
        self.resyncs += 1
        self.entered.set()
        assert self.listing.wait(10), "the list was never let finish"
        if self.refused:
            raise client.ApiException(status=403, reason="Forbidden")

    def state(self, key, uid):
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


def test_a_reclaim_is_re_planned_while_the_heartbeat_is_still_listing_the_pods():
    # The full list took 3-6 s at 2,000 nodes on a loaded control plane, and a reclaim that
    # came while a pass read it waited for all of it (bench_operator_replan.py).
    r, applied, _ = _reconciler(["n0", "n1", "n2", "n3"])
    record = r._record(KEY)
    record.state = c.new_job(SPEC, r.settings)
    _run(r, record)
    r.cache.listing.clear()
    heartbeat = threading.Thread(target=r._resync, args=(KEY, UID, record))
    heartbeat.start()
    assert r.cache.entered.wait(10)
    try:
        _lose(r, "n1")
        _run(r, record)
        assert _plans(applied)[-1] == ["n0", "n2", "n3"]
        r._resync(KEY, UID, record)  # the next heartbeat does not list twice at once
        assert heartbeat.is_alive() and r.cache.resyncs == 1
    finally:
        r.cache.listing.set()
        heartbeat.join()
    r._resync(KEY, UID, record)  # a list ended just now: the next is due in RELIST_S
    assert r.cache.resyncs == 1
    record.listed_at -= RELIST_S
    r._resync(KEY, UID, record)
    assert r.cache.resyncs == 2


def test_a_list_the_api_server_refuses_is_logged_and_tried_again_a_relist_later(caplog):
    r, _, _ = _reconciler(["n0", "n1"])
    record = r._record(KEY)
    r.cache.refused = True
    r._resync(KEY, UID, record)  # does not raise: the heartbeat's pass still runs
    assert "could not list the job's pods and nodes" in caplog.text
    r._resync(KEY, UID, record)  # not once per heartbeat
    assert r.cache.resyncs == 1
    record.listed_at -= RELIST_S
    r._resync(KEY, UID, record)
    assert r.cache.resyncs == 2


class ListingCache(ClusterCache):
    """A ClusterCache whose lists return ``nodes``, ``workers`` and ``state`` as they were
    read before ``during`` (watch events that come while a list is read) and
    ``during_read`` (while the state is read) ran."""

    def __init__(self, nodes, workers, state):
        super().__init__(None)
        self.during = self.during_read = lambda: None

        def listed(items):
            self.during()
            return SimpleNamespace(data=json.dumps({"items": items, "metadata": {}}))

        def read_state(name, namespace):
            self.during_read()
            return SimpleNamespace(data=dict(self.listed_state), metadata=SimpleNamespace(
                owner_references=[SimpleNamespace(uid=UID)]))

        self.listed_state = state
        self.core = SimpleNamespace(
            list_node=lambda **_: listed([_node(n) for n in nodes]),
            list_namespaced_pod=lambda namespace, label_selector, **_: listed(
                workers if "role=worker" in label_selector else []),
            read_namespaced_config_map=read_state)


def test_a_list_of_the_nodes_does_not_undo_a_deletion_the_watch_delivered_meanwhile():
    nodes = ["n0", "n1", "n2"]
    cache = ListingCache(nodes, [_worker(n, i) for i, n in enumerate(nodes)], {})
    for n in nodes:
        cache.node_changed(_node(n), n)
    cache.during = lambda: cache.node_changed(None, "n1")
    cache.resync(KEY, UID)
    assert "n1" in cache.gone and "n1" not in cache.nodes
    assert set(cache.nodes) == {"n0", "n2"}


def test_a_list_of_the_pods_does_not_undo_what_the_watch_delivered_meanwhile():
    old = [_worker("n0", 0), _worker("n1", 1), _worker("n2", 2)]
    new = _worker("n3", 3)
    # Read before j-worker-1's deletion, j-worker-3's creation and the state's change
    # reached the watch, and after j-worker-2 went without the watch saying so.
    cache = ListingCache(["n0", "n1", "n2", "n3"], old[:2], {"progress": "old"})
    for pod in old:
        cache.pod_changed(KEY, "worker", pod, deleted=False)

    def during():
        cache.during = lambda: None
        cache.pod_changed(KEY, "worker", old[1], deleted=True)
        cache.pod_changed(KEY, "worker", new, deleted=False)

    def during_read():
        cache.during_read = lambda: None
        cache.state_changed(KEY, {"progress": "new"})

    cache.during, cache.during_read = during, during_read
    cache.resync(KEY, UID)
    assert sorted(p["metadata"]["name"] for p in cache.pods(KEY, "worker")) == [
        "j-worker-0", "j-worker-3"]
    assert cache.state(KEY, UID) == {"progress": "new"}
    # With no event during it, a list is the truth.
    cache.listed_state = {"progress": "newest"}
    cache.resync(KEY, UID)
    assert sorted(p["metadata"]["name"] for p in cache.pods(KEY, "worker")) == [
        "j-worker-0", "j-worker-1"]
    assert cache.state(KEY, UID) == {"progress": "newest"}


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


class PublishingCore:
    """The calls ``Applier._publish`` makes: the plan written, and the pods patched."""

    def __init__(self):
        self.annotated = []

    def create_namespaced_config_map(self, namespace, cm):
        return SimpleNamespace(metadata=SimpleNamespace(resource_version="1"))

    def create_namespaced_event(self, namespace, event):
        pass

    def patch_namespaced_pod(self, name, namespace, patch):
        self.annotated.append(name)


class InTurn:
    """An executor that runs each task as it is submitted."""

    def submit(self, fn, *args):
        fn(*args)


def _annotated(changes_after: int, monkeypatch) -> list[str]:
    """The pods annotated once generation 1 on four nodes is published, when node changes
    come after ``changes_after`` looks (the fan-out looks once, then once per pod)."""
    from lazarus_operator import apply

    monkeypatch.setattr(apply, "ANNOTATE_AFTER_S", 0.0)
    nodes = ["n0", "n1", "n2", "n3"]
    r, applied, _ = _reconciler(nodes)
    record = r._record(KEY)
    record.state = c.new_job(SPEC, r.settings)
    _run(r, record)
    publish = next(d for o in applied for d in o.decisions if isinstance(d, c.PublishPlan))
    applier = Applier(client.CoreV1Api(client.ApiClient()), None, None, lambda: 0.0, 2379)
    applier.core, applier._background = PublishingCore(), InTurn()
    looks, done = [], threading.Event()

    def overtaken():
        looks.append(None)
        if len(looks) == 1 + len(nodes):
            done.set()
        return len(looks) > changes_after

    obs = Observation(pod_on={n: f"j-worker-{i}" for i, n in enumerate(nodes)})
    body = {"apiVersion": "lazarus.dev/v1alpha1", "kind": "LazarusJob", **BODY}
    applier._publish(JobRecord(), body, publish, frozenset(), obs, 0.0, "", overtaken)
    done.wait(5)
    return applier.core.annotated


def test_pods_are_annotated_with_the_generation_published(monkeypatch):
    assert sorted(_annotated(10, monkeypatch)) == [f"j-worker-{i}" for i in range(4)]


def test_pods_are_not_annotated_with_a_generation_that_node_changes_overtook(monkeypatch):
    # A new generation is due: the fan-out (a thousand patches at a thousand nodes) must not
    # compete with its re-plan; that generation's own fan-out covers the pods.
    assert len(_annotated(2, monkeypatch)) == 1


def test_a_node_gone_for_long_is_forgotten_and_looked_up_again_if_a_pod_names_it():
    """A spot cluster names each new node anew: the cache must not remember every node it
    ever lost. One still named by a pod after that is asked for once, and found gone."""
    from kubernetes.client.exceptions import ApiException

    from lazarus_operator.cluster_cache import GONE_KEPT_S

    now = [0.0]
    lookups = []

    def read_node(name, **_):
        lookups.append(name)
        raise ApiException(status=404, reason="Not Found")

    cache = ClusterCache(SimpleNamespace(read_node=read_node), clock=lambda: now[0])
    for i in range(100):
        cache.node_changed(_node(f"spot-{i}"), f"spot-{i}")
        cache.node_changed(None, f"spot-{i}")
        now[0] += 1.0
    assert len(cache.gone) == 100
    assert cache.node_infos([_worker("spot-3", 0)]) == {"spot-3": None} and lookups == []

    now[0] += GONE_KEPT_S - 50.0  # the first 50 went more than GONE_KEPT_S ago
    cache.node_changed(None, "spot-100")
    assert sorted(cache.gone) == sorted(f"spot-{i}" for i in range(50, 101))
    assert ("node", "spot-3") not in cache._event_of
    assert cache.node_infos([_worker("spot-3", 0)]) == {"spot-3": None}
    assert cache.node_infos([_worker("spot-3", 0)]) == {"spot-3": None}
    assert lookups == ["spot-3"], "a node found gone is remembered as gone"
    # A node that comes back is no longer gone; deleted again, it counts from then.
    cache.node_changed(_node("spot-60"), "spot-60")
    assert "spot-60" not in cache.gone and "spot-60" in cache.nodes
