"""CheckpointHealthy: what the workers reported about their latest checkpoint, carried from
the coordinator's progress report to a condition that names the fix."""
from lazarus_core import controller as c
from lazarus_core.cluster_contract import progress_json, read_progress
from lazarus_core.job_spec import parse_spec
from lazarus_core.topology import NodeSpec

T0 = 1_000.0
NOW = "2026-01-01T00:00:00Z"


def started(checkpoint: dict | None):
    spec = parse_spec({"runtime": {"experts": 4, "layers": 2}, "minNodes": 2, "maxNodes": 2,
                       "slotsPerGpu": 4} | ({"checkpoint": checkpoint} if checkpoint else {}))
    state = c.new_job(spec, c.Settings(start_grace_s=0))
    return c.handle(state, c.NodesJoined(tuple(NodeSpec(f"n{i}", 1, 4, "a") for i in range(2))),
                    T0).state


def health(state, previous=()):
    return {x["type"]: x for x in c.status(state, list(previous), NOW)["conditions"]}.get(
        "CheckpointHealthy")


def test_the_condition_goes_false_with_the_reason_then_true_when_writes_succeed_again():
    state = started({"path": "s3://bucket/ckpt", "everySteps": 10, "secretName": "creds"})
    assert health(state)["status"] == "Unknown"
    state = c.handle(state, c.Progress(step=10, generation=1, checkpoint_step=10), T0).state
    ok = health(state)
    assert (ok["status"], ok["reason"]) == ("True", "CheckpointWritten")

    error = "checkpoint of step 20 skipped: writing the shard of rank 1 failed 3 time(s)"
    state = c.handle(state, c.Progress(step=20, generation=1, checkpoint_step=10,
                                       checkpoint_error=error, checkpoint_failures=1), T0).state
    bad = health(state, [ok])
    assert (bad["status"], bad["reason"]) == ("False", "CheckpointWriteFailed")
    for words in (error, "Training goes on", "step 10", "s3://bucket/ckpt", "Secret creds"):
        assert words in bad["message"], words
    assert bad["lastTransitionTime"] == NOW

    state = c.handle(state, c.Progress(step=30, generation=1, checkpoint_step=30,
                                       checkpoint_failures=1), T0).state
    healed = health(state, [bad])
    assert (healed["status"], healed["reason"]) == ("True", "CheckpointWritten")
    assert state.checkpoint_failures == 1  # the count of skipped checkpoints stays


def test_a_job_without_checkpoints_has_no_such_condition():
    assert health(started(None)) is None


def test_the_progress_report_carries_checkpoint_health_through_the_pod_annotation():
    p = c.Progress(step=7, generation=2, checkpoint_step=5, checkpoint_error="refused",
                   checkpoint_failures=3)
    assert read_progress(progress_json(p)) == p
    healthy = c.Progress(step=7, generation=2, checkpoint_step=5)
    assert read_progress(progress_json(healthy)) == healthy
