"""Durable checkpoints, end to end: a LazarusJob on the real API server, its coordinator and
workers real processes (tests/testcluster/kubelet.py), each pod in a working directory and
HOME of its own. Storage refuses writes and heals; the newest checkpoint is corrupt when a
zone is lost; checkpoints go to a real S3 server (moto, on 127.0.0.1) with credentials from
a Secret; a worker cannot start. Each scenario's figures (fault to the next completed step,
steps lost) go to build/e2e-results.json like test_full_stack's.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from lazarus_runtime.checkpoint import Checkpoints
from jobkit import JobClient
from test_full_stack import (STEP_TIMEOUT_S, TOLERANCE, Stack, assert_losses_match,  # noqa: F401
                             job_manifest, record, stack, start_operator)
from testcluster import faults
from testcluster.kubelet import LABEL, LocalKubelet
from testcluster.waits import wait_until

pytestmark = pytest.mark.cluster


class StepWatch:
    """The steps of every checkpoint a store shows complete, looked at every ``every_s``
    from construction until ``stop``: a job prunes all but its newest few as it trains on,
    and one look may come too late (a checkpoint stays until a few newer ones complete:
    many looks)."""

    def __init__(self, store: Checkpoints, every_s: float = 0.1):
        self._store, self._every_s = store, every_s
        self._seen: set[int] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._look, daemon=True)
        self._thread.start()

    def _look(self) -> None:
        while not self._stopped.is_set():
            steps = {ck.step for ck in self._store.complete()}
            with self._lock:
                self._seen |= steps
            self._stopped.wait(self._every_s)

    def steps(self) -> set[int]:
        with self._lock:
            return set(self._seen)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


def uid(stack: Stack) -> str:
    return stack.jobs.get(stack.name)["metadata"]["uid"]


def health(stack: Stack) -> dict:
    return stack.jobs.condition(stack.name, "CheckpointHealthy")


def wait_health(stack: Stack, status: str) -> dict:
    return wait_until(lambda: (c := health(stack)).get("status") == status and c,
                      timeout=STEP_TIMEOUT_S, what=f"CheckpointHealthy={status}",
                      describe=lambda: f"{health(stack)}; {stack.describe()}")


def events(stack: Stack, reason: str) -> list:
    return [e for e in stack.jobs.events(stack.name) if e.reason == reason]


def assert_each_step_committed_once_in_order(stack: Stack) -> None:
    """No step skipped, none applied twice: every sample trained exactly once."""
    commits = stack.commits()
    assert commits == list(range(1, len(commits) + 1)), commits


def test_refused_checkpoint_writes_never_stop_training_and_the_condition_heals(
        cluster, stack, scratch_nodes):
    scratch_nodes("gpu-spot", num_zones=1, nodes_per_zone=2)
    stack.apply(replicas=2)
    wait_health(stack, "True")
    folder = stack.tmp / "ckpt" / uid(stack)  # the job's own folder under checkpoint.path
    generation, before = stack.generation(), stack.last_step()

    fault_at = time.time()
    folder.rename(folder.with_name("moved-away"))
    folder.write_text("not a folder: every write below it fails")
    refused = wait_health(stack, "False")
    assert refused["reason"] == "CheckpointWriteFailed", refused
    assert "checkpoint of step" in refused["message"] and str(stack.tmp) in refused["message"]
    resumed = stack.wait_step(before + 1)
    assert events(stack, "CheckpointWriteFailed"), "no Warning Event for the skipped checkpoint"
    assert stack.operator.metric("lazarus_checkpoint_write_failures_total") >= 1
    assert stack.operator.metric("lazarus_checkpoint_healthy") == 0

    folder.unlink()
    folder.with_name("moved-away").rename(folder)
    healed = wait_health(stack, "True")
    stack.wait_step(stack.last_step() + 2)
    assert events(stack, "CheckpointWritten"), "no Event when checkpoints were written again"
    assert stack.operator.metric("lazarus_checkpoint_healthy") == 1
    # Training never stopped: no reconfiguration, every step committed once, in order.
    assert stack.generation() == generation
    assert_each_step_committed_once_in_order(stack)
    record("checkpoint storage refuses writes, then heals", {
        "fault_to_next_step_s": round(resumed["time"] - fault_at, 3),
        "resumed_at_step": resumed["step"], "steps_lost": 0, "samples_lost": 0,
        "samples_duplicated": 0, "checkpoints_skipped": int(stack.operator.metric(
            "lazarus_checkpoint_write_failures_total")),
        "healed_message": healed["message"]})


def lose_the_zone_and_measure(cluster, stack: Stack, scratch_nodes, zone: str,
                              scenario: str, while_down=lambda: None) -> dict:
    """Every worker's zone lost at once (no replica of anything survives), capacity back
    in a new zone: the workers there restore a checkpoint. ``while_down`` runs in between."""
    generation = stack.generation()
    zone_at = time.time()
    faults.zone_down(cluster.core, zone, delete=True)
    while_down()
    scratch_nodes("gpu-spot", num_zones=1, nodes_per_zone=2)
    stack.wait_step(stack.last_step() + 1, after_generation=generation)
    m = stack.measure(scenario, zone_at, generation)
    assert m["restored_step"] is not None, m
    return m


def test_a_corrupt_newest_checkpoint_gives_way_to_the_previous_one_after_a_zone_loss(
        cluster, stack, scratch_nodes):
    [(zone, _)] = scratch_nodes("gpu-spot", num_zones=1, nodes_per_zone=2).items()
    stack.apply(replicas=2)
    store = Checkpoints.open(str(stack.tmp / "ckpt"), uid(stack))
    wait_until(lambda: len(store.complete()) >= 2, timeout=STEP_TIMEOUT_S,
               what="two complete checkpoints", describe=stack.describe)

    def corrupt_the_newest():
        """Once the workers are gone, so that no newer checkpoint can follow (training
        runs a checkpoint a second here); the coordinator may still be completing the
        last one, hence the pause."""
        time.sleep(1.0)
        newest, previous = store.complete()[:2]
        shard = f"step-{newest.step:08d}/{newest.shards[0]['file']}"
        data = bytearray(store.storage.get(shard))
        data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
        store.storage.put(shard, bytes(data))
        picked.update(newest=newest, previous=previous)

    picked = {}
    m = lose_the_zone_and_measure(cluster, stack, scratch_nodes, zone,
                                  "zone lost with the newest checkpoint corrupt",
                                  while_down=corrupt_the_newest)
    newest, previous = picked["newest"], picked["previous"]
    assert m["restored_step"] == previous.step, (m, newest.step, previous.step)
    skipped = [e["message"] for e in stack.events("info") if "checkpoint skipped" in e["message"]]
    assert any(f"step-{newest.step:08d}" in s and "checksum mismatch" in s for s in skipped)
    assert_losses_match(stack, m)


def test_checkpoints_on_s3_restore_workers_that_share_no_disk(cluster, stack, scratch_nodes,
                                                               s3_server, s3_bucket):
    [(zone, _)] = scratch_nodes("gpu-spot", num_zones=1, nodes_per_zone=2).items()
    cluster.core.create_namespaced_secret(stack.namespace, {
        "metadata": {"name": "checkpoint-credentials"}, "stringData": s3_server.env()})
    location = f"s3://{s3_bucket}/lazarus/e2e"
    stack.apply(replicas=2, checkpoint={"path": location, "everySteps": 5,
                                        "secretName": "checkpoint-credentials"})
    store = Checkpoints.open(location, uid(stack))  # this process: env from s3_bucket
    wait_until(lambda: store.latest(), timeout=STEP_TIMEOUT_S, what="a checkpoint on S3",
               describe=stack.describe)

    m = lose_the_zone_and_measure(cluster, stack, scratch_nodes, zone,
                                  "zone lost: restore from S3, no shared disk")
    assert m["restored_step"] in {ck.step for ck in store.complete()}, m
    assert_losses_match(stack, m)
    # Nothing was written to a pod's own disk (s3://... once became a folder named 's3:').
    homes = list((stack.tmp / "kubelet").glob("*/home"))
    # A folder per pod name: every pod running now has one (a replacement may take a lost
    # worker's free index, and with it that worker's name and folder).
    running = {pod.metadata.name
               for pod in cluster.core.list_namespaced_pod(stack.namespace).items}
    assert len(running) >= 3 and running <= {home.parent.name for home in homes}, homes
    assert not [f for home in homes for f in home.rglob("step-*")]
    # The credentials reached the pods only through the Secret.
    manifest = stack.jobs.get(stack.name)
    assert "lazarus-test-secret" not in str(manifest)


def test_a_worker_that_cannot_start_backs_off_and_the_job_says_why(cluster, stack,
                                                                   scratch_nodes):
    scratch_nodes("gpu-spot", num_zones=1, nodes_per_zone=2)
    runtime = {"model": "tiny", "experts": 4, "layers": 2, "topK": 2,
               "dataset": "/data/corpus-that-is-not-mounted.txt"}  # only a worker can tell
    stack.apply(replicas=2, runtime=runtime)
    ready = wait_until(
        lambda: (c := stack.jobs.condition(stack.name, "Ready")).get("reason")
        == "WorkerStartFailed" and c, timeout=STEP_TIMEOUT_S,
        what="Ready=WorkerStartFailed", describe=stack.describe)
    assert ready["status"] == "False"
    assert "corpus-that-is-not-mounted" in ready["message"], ready["message"]

    # Replacements come ever more slowly: after the first failure of each round (the two
    # workers of a round start together and fail within a second or so of each other), the
    # next workers are scheduled 2, 4, 8, then 16 s later. Without a backoff they would be
    # at once. (The operator posts a failure's event a moment after it decides the wait:
    # each is allowed a second less.)
    def failures() -> list:
        failed = sorted(e.first_timestamp for e in events(stack, "WorkerStartFailed"))
        return [t for i, t in enumerate(failed)
                if i == 0 or (t - failed[i - 1]).total_seconds() > 2]

    def scheduled() -> list:
        return sorted(e.event_time or e.first_timestamp
                      for e in cluster.core.list_namespaced_event(stack.namespace).items
                      if e.reason == "Scheduled"
                      and e.involved_object.name.startswith(f"{stack.name}-worker-"))
    wait_until(lambda: len(failures()) >= 5, timeout=150, what="five rounds of failed starts",
               describe=lambda: f"{failures()}; {stack.describe()}")
    rounds, starts = failures(), scheduled()
    waits = [min((s - failed).total_seconds() for s in starts if s > failed)
             for failed in rounds[:4]]
    assert all(w >= 2 ** (k + 1) - 1 for k, w in enumerate(waits)), waits
    workers = cluster.core.list_namespaced_pod(
        stack.namespace, label_selector=f"lazarus.dev/job={stack.name},lazarus.dev/role=worker")
    # No pile of crash-looping pods: at any moment at most one replacement per worker the
    # job wants (a failed pod's deletion and its replacement's start overlap), and the
    # timing above shows replacements come ever more slowly.
    names = [p.metadata.name for p in workers.items]
    assert len(names) <= 2 * 2 and stack.last_step() == 0, names
    record("worker cannot start (runtime.dataset missing)", {
        "rounds": len(rounds), "waits_s": [round(w, 1) for w in waits],
        "ready_message": ready["message"]})


@dataclass
class Neighbour:
    """A second job's whole stack beside the test's: its own namespace, operator, kubelet."""
    stack: Stack
    nodes: callable  # (pool, zones, per zone) -> {zone: [names]}, labelled for it


@pytest.fixture
def neighbour(cluster, stack, operator_factory, scratch_nodes, tmp_path):
    from kubernetes import client

    namespace = f"{stack.namespace[:54]}-next"
    cluster.core.create_namespace({"metadata": {"name": namespace,
                                                "labels": {"lazarus.dev/test": "true"}}})
    wait_until(lambda: cluster.core.list_namespaced_service_account(
        namespace, field_selector="metadata.name=default").items, timeout=30,
        what=f"the default ServiceAccount of {namespace}")
    kubelet = LocalKubelet(cluster.api, namespace, tmp_path / "kubelet-next").start()

    def nodes(pool: str, num_zones: int = 1, nodes_per_zone: int = 1) -> dict:
        made = scratch_nodes(pool, num_zones=num_zones, nodes_per_zone=nodes_per_zone)
        for name in (n for names in made.values() for n in names):
            cluster.core.patch_node(name, {"metadata": {"labels": {
                "lazarus.dev/scratch": namespace}}})
        return made

    nodes("system")
    jobs = JobClient(client.CustomObjectsApi(cluster.api), cluster.core, namespace)
    tmp = tmp_path / "next"
    tmp.mkdir()
    yield Neighbour(replace(stack, namespace=namespace, jobs=jobs, kubelet=kubelet,
                            operator=start_operator(operator_factory, watch=namespace),
                            tmp=tmp), nodes)
    kubelet.stop()
    cluster.core.delete_collection_namespaced_pod(namespace, label_selector=LABEL,
                                                  body={"gracePeriodSeconds": 0})
    cluster.core.delete_namespace(namespace)


def own_reference(stack: Stack, runtime: dict, steps: int) -> list[float]:
    """The job with this runtime section, failure-free, on the local backend."""
    from lazarus_core.job_spec import parse_manifest

    from lazarus_runtime.local_backend import LocalJob

    name, spec = parse_manifest(job_manifest("reference", "default", stack.tmp / "ref-ckpt",
                                             runtime=runtime))
    return LocalJob(name, spec, 2, steps, checkpoint_dir=stack.tmp / "ref-ckpt").run().losses


def test_two_jobs_with_one_checkpoint_path_each_restore_their_own(cluster, stack, neighbour,
                                                                  scratch_nodes):
    shared = stack.tmp / "shared-ckpt"  # both jobs name it; both are called e2e, too
    tiny = {"model": "tiny", "experts": 4, "layers": 2, "topK": 2, "learningRate": "0.003"}
    b = neighbour.stack
    jobs = {"a": (stack, scratch_nodes, tiny | {"seed": 0}),
            "b": (b, neighbour.nodes, tiny | {"seed": 1})}  # different weights, losses
    zones, stores = {}, {}
    for key, (s, make_nodes, runtime) in jobs.items():
        [(zones[key], _)] = make_nodes("gpu-spot", num_zones=1, nodes_per_zone=2).items()
        s.apply(replicas=2, runtime=runtime,
                checkpoint={"path": str(shared), "everySteps": 5})
    for key, (s, _, _) in jobs.items():
        stores[key] = Checkpoints.open(str(shared), uid(s))
        wait_until(lambda store=stores[key]: len(store.complete()) >= 2,
                   timeout=STEP_TIMEOUT_S, what=f"two checkpoints of job {key}",
                   describe=s.describe)
    assert sorted(p.name for p in shared.iterdir()) == sorted([uid(stack), uid(b)])

    generations = {key: s.generation() for key, (s, _, _) in jobs.items()}
    # Every checkpoint each job completes under its own UID, watched from before its zone
    # goes down: it prunes all but the newest few as it trains on, and while the test waits
    # on one job the other trains far (job b restored step 15 and had pruned it by 245).
    own = {key: StepWatch(store) for key, store in stores.items()}
    fault_at, measured = {}, {}
    try:
        for key, (s, make_nodes, _) in jobs.items():
            fault_at[key] = time.time()
            faults.zone_down(cluster.core, zones[key], delete=True)
            make_nodes("gpu-spot", num_zones=1, nodes_per_zone=2)
        for key, (s, _, _) in jobs.items():
            s.wait_step(s.last_step() + 1, after_generation=generations[key])
            m = measured[key] = s.measure(
                f"two jobs, one checkpoint path: job {key} restores its own", fault_at[key],
                generations[key])
            assert m["restored_step"] in own[key].steps(), (m, own[key].steps())
    finally:
        for watch in own.values():
            watch.stop()
    for key, (s, _, runtime) in jobs.items():
        upto = measured[key]["resumed_at_step"] + 5
        s.wait_step(upto)
        losses, reference = s.losses(), own_reference(s, runtime, upto)
        worst = max(abs(losses[i] - reference[i - 1]) for i in range(1, upto + 1))
        assert worst <= TOLERANCE, f"job {key}: largest loss difference {worst:.2e}"
    assert stack.losses()[1] != b.losses()[1]  # two different models: the check has teeth
