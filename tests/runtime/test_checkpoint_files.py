"""Checkpoint files on a shared disk and on a real S3 server (moto, over a socket): every
expert saved once, nothing half-written trusted, corrupt checkpoints skipped for the previous
complete one, old ones deleted, jobs kept apart, failed writes retried and then given up."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from lazarus_core.solver import plan_job
from lazarus_core.topology import NodeSpec
from lazarus_runtime import checkpoint
from lazarus_runtime.checkpoint import (CheckpointError, Checkpoints, CheckpointWriteFailed,
                                        RetryPolicy)
from lazarus_runtime.storage import StorageError, open_storage

FAST_RETRY = RetryPolicy(attempts=3, first_delay_s=0.05, factor=2.0)


@pytest.fixture(params=["disk", "s3"])
def location(request, tmp_path) -> str:
    """A checkpoint path of each kind the workers support."""
    if request.param == "disk":
        return str(tmp_path / "ckpt")
    return f"s3://{request.getfixturevalue('s3_bucket')}/lazarus/ckpt"


def state(value: float) -> dict:
    return {"w": torch.full((4,), value)}


def save(store: Checkpoints, step: int, ranks: int = 2) -> list[dict]:
    """A complete checkpoint of ``step``: rank r saves expert (0, r), rank 0 the dense."""
    shards = [store.write_shard(step, r, {(0, r): state(step + r)},
                                state(-step) if r == 0 else None) for r in range(ranks)]
    store.write_manifest(step, shards)
    return shards


def test_a_checkpoint_round_trips_with_every_state_it_saved(location):
    store = Checkpoints.open(location, "job-uid-1", retry=FAST_RETRY)
    save(store, 5)
    ck = Checkpoints.open(location, "job-uid-1").latest()  # another process's view
    assert ck.step == 5
    dense, experts = ck.load({(0, 0), (0, 1)})
    assert torch.equal(dense["w"], state(-5)["w"])
    assert torch.equal(experts[(0, 1)]["w"], state(6)["w"])
    ck.verify()


def test_an_unfinished_or_truncated_newest_checkpoint_is_skipped(location):
    store = Checkpoints.open(location, "uid", retry=FAST_RETRY)
    save(store, 5)
    store.write_shard(10, 0, {(0, 0): state(1)}, state(1))  # no manifest: never finished
    shards = save(store, 15)
    # Step 15's shard of rank 1 cut short, as by an interrupted copy.
    path = f"step-00000015/{shards[1]['file']}"
    store.storage.put(path, store.storage.get(path)[:-7])
    assert [ck.step for ck in store.complete()] == [5]
    assert store.latest().step == 5
    assert store.latest(at_most=4) is None


def test_a_corrupt_newest_checkpoint_gives_way_to_the_previous_complete_one(location):
    store = Checkpoints.open(location, "uid", retry=FAST_RETRY)
    save(store, 5)
    shards = save(store, 10)
    path = f"step-00000010/{shards[0]['file']}"
    data = bytearray(store.storage.get(path))
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, so only the checksum tells
    store.storage.put(path, bytes(data))

    with pytest.raises(CheckpointError, match="checksum mismatch"):
        store.latest().load({(0, 0)})
    ck, skipped = store.newest_intact()
    assert ck.step == 5 and len(skipped) == 1 and "checksum mismatch" in skipped[0]
    assert torch.equal(ck.load({(0, 0)})[1][(0, 0)]["w"], state(5)["w"])


def test_a_tampered_manifest_is_refused(location):
    store = Checkpoints.open(location, "uid", retry=FAST_RETRY)
    save(store, 5)
    save(store, 10)
    path = "step-00000010/manifest.json"
    store.storage.put(path, store.storage.get(path).replace(b'"dense": true', b'"dense": false'))
    assert store.latest().step == 5


def test_only_the_newest_keep_checkpoints_stay(location):
    store = Checkpoints.open(location, "uid", keep=2, retry=FAST_RETRY)
    for step in (5, 10, 15):
        save(store, step)
    store.write_shard(20, 0, {(0, 0): state(1)}, state(1))  # in writing: stays
    save(store, 25)
    assert [ck.step for ck in store.complete()] == [25, 15]
    assert sorted(store.storage.listing()) == ["step-00000015", "step-00000020",
                                               "step-00000025"]


def test_two_jobs_with_one_path_never_share_files(location):
    a = Checkpoints.open(location, "uid-a", retry=FAST_RETRY)
    b = Checkpoints.open(location, "uid-b", retry=FAST_RETRY)
    save(a, 5)
    save(b, 5)
    save(b, 10)
    assert a.storage.root != b.storage.root
    assert [ck.step for ck in a.complete()] == [5]
    _, experts = a.latest().load({(0, 0)})
    assert torch.equal(experts[(0, 0)]["w"], state(5)["w"])
    assert b.latest().step == 10


def test_each_writer_names_its_files_so_none_overwrites_another(location):
    first = Checkpoints.open(location, "uid", retry=FAST_RETRY)
    second = Checkpoints.open(location, "uid", retry=FAST_RETRY)  # a redo, another pod
    kept = first.write_shard(5, 0, {(0, 0): state(1)}, state(1))
    first.write_manifest(5, [kept])
    other = second.write_shard(5, 0, {(0, 0): state(2)}, state(2))
    assert kept["file"] != other["file"]
    assert first.storage.writer != second.storage.writer
    assert str(os.getpid()) not in kept["file"]
    _, experts = first.latest().load({(0, 0)})  # the manifest's own shard, untouched
    assert torch.equal(experts[(0, 0)]["w"], state(1)["w"])


def test_a_disk_write_leaves_no_temporary_file(tmp_path):
    store = Checkpoints.open(str(tmp_path), "uid", retry=FAST_RETRY)
    save(store, 5)
    names = sorted(p.name for p in (tmp_path / "uid" / "step-00000005").iterdir())
    assert len(names) == 3 and "manifest.json" in names, names  # two shards, one manifest
    assert not any(".tmp-" in n for n in names)


def test_a_refused_write_is_retried_with_backoff_then_given_up(tmp_path):
    store = Checkpoints.open(str(tmp_path), "uid", retry=FAST_RETRY)
    (tmp_path / "uid").write_text("a file where the job's folder should be")
    start = time.monotonic()
    with pytest.raises(CheckpointWriteFailed, match="failed 3 time") as e:
        store.write_shard(5, 0, {(0, 0): state(1)}, state(1))
    assert time.monotonic() - start >= sum(FAST_RETRY.delays())
    assert "shard of rank 0, step 5" in str(e.value)
    # Healed: the next checkpoint is written as if nothing happened.
    (tmp_path / "uid").unlink()
    save(store, 10)
    assert store.latest().step == 10


def test_a_store_that_heals_between_attempts_loses_nothing(tmp_path):
    store = Checkpoints.open(str(tmp_path), "uid",
                             retry=RetryPolicy(attempts=3, first_delay_s=0.5))
    blocked = tmp_path / "uid"
    blocked.write_text("a file where the job's folder should be")
    healer = threading.Timer(0.2, blocked.unlink)  # during the first backoff
    healer.start()
    info = store.write_shard(5, 0, {(0, 0): state(1)}, state(1))
    healer.join()
    store.write_manifest(5, [info])
    assert store.latest().step == 5


def test_retries_stop_when_interrupted(tmp_path):
    store = Checkpoints.open(str(tmp_path), "uid", retry=RetryPolicy(attempts=5,
                                                                      first_delay_s=10))
    (tmp_path / "uid").write_text("a file where the job's folder should be")
    start = time.monotonic()
    with pytest.raises(CheckpointWriteFailed, match="failed 1 time"):
        store.write_shard(5, 0, {}, state(1), interrupted=lambda: True)
    assert time.monotonic() - start < 5


def test_writes_to_a_missing_bucket_fail_and_succeed_once_it_exists(s3_server, s3_bucket):
    bucket = f"t-missing-{s3_bucket}"[:60]
    store = Checkpoints.open(f"s3://{bucket}/ckpt", "uid", retry=FAST_RETRY)
    with pytest.raises(CheckpointWriteFailed, match="failed 3 time"):
        store.write_shard(5, 0, {(0, 0): state(1)}, state(1))
    s3_server.create_bucket(bucket)
    save(store, 10)
    assert store.latest().step == 10


@pytest.mark.parametrize("location", ["gs://bucket/ckpt", "s3://bucket/ckpt",
                                      "file:///data/ckpt", "/data/ckpt"])
def test_every_supported_scheme_opens_as_an_fsspec_filesystem(location):
    storage = open_storage(location, "uid")
    assert storage.root.endswith("/ckpt/uid")
    assert storage.local == location.startswith(("/", "file://"))
    assert hasattr(storage.fs, "pipe_file") and hasattr(storage.fs, "cat_file")


@pytest.mark.parametrize("location", ["ckpt", "s3:/bucket", "hdfs://nn/ckpt", "/data/../etc"])
def test_a_location_workers_cannot_share_is_refused(location):
    with pytest.raises(StorageError, match="checkpoint path"):
        open_storage(location, "uid")


@pytest.mark.parametrize("policy", ["mro", "spread", "compact"])
@pytest.mark.parametrize("nodes,slots,min_replicas", [(4, 4, 2), (5, 3, 3), (3, 6, 1)])
def test_each_expert_is_owned_once_by_its_lowest_ranked_holder(policy, nodes, slots,
                                                                min_replicas):
    specs = [NodeSpec(f"n{i}", gpus=1, slots_per_gpu=slots, zone=f"z{i % 2}")
             for i in range(nodes)]
    plan = plan_job(specs, experts=4, layers=2, min_replicas=min_replicas, policy=policy)
    owned = {rank: checkpoint.owned_experts(plan, rank) for rank in range(plan.world_size)}
    keys = [key for keys in owned.values() for key in keys]
    assert sorted(keys) == [(layer, e) for layer in range(2) for e in range(4)]
    for rank, keys in owned.items():
        for layer, e in keys:
            holders = [r for r in range(plan.world_size) if e in plan.rank_experts(layer, r)]
            assert rank == min(holders)
