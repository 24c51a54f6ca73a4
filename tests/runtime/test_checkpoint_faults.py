"""Storage faults never stop training: real worker processes checkpointing to a folder that
refuses writes for a while."""
import pytest

from elastic_jobs import STEPS, Fault, manifest, run
from lazarus_runtime.checkpoint import Checkpoints

pytestmark = pytest.mark.slow


def test_refused_checkpoint_writes_skip_checkpoints_not_steps(tmp_path):
    path = manifest(tmp_path, "refused")  # a checkpoint every 10 steps
    target = tmp_path / "ckpt" / "refused"  # where run() points the job's checkpoints

    def storage_fault(status: dict) -> None:
        if status["step"] == 8:  # a file where the folder should be: every write fails
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("not a folder")
        elif status["step"] == 22:
            target.unlink()

    result = run(path, workers=3, on_progress=storage_fault)
    assert result.steps_completed == STEPS and result.failures == 0
    assert result.reconfigurations == [] and result.samples_lost == 0
    # Steps 10 and 20 found the folder refusing writes and were skipped; 30 was written.
    assert [ck.step for ck in Checkpoints.open(str(target), None).complete()] == [30]


def test_a_restore_skips_a_corrupt_newest_checkpoint_for_the_previous_one(tmp_path):
    # compact placement, 3 slots per worker: worker-0 holds all three replicas of expert 0,
    # so killing it forces a restore. Checkpoints at steps 10 and 20; 20 is corrupted first.
    path = manifest(tmp_path, "corrupt", placement="compact", slotsPerGpu=3)
    store = Checkpoints.open(str(tmp_path / "ckpt" / "corrupt"), None)

    def corrupt_step_20(status: dict) -> None:
        if status["step"] == 22:
            shard = store.at(20).shards[0]["file"]
            data = bytearray(store.storage.get(f"step-00000020/{shard}"))
            data[len(data) // 2] ^= 0xFF
            store.storage.put(f"step-00000020/{shard}", bytes(data))

    events = []
    result = run(path, workers=4, kills=[Fault(25, names=("worker-0",))],
                 on_progress=corrupt_step_20, events=events)
    (reconfig,) = result.reconfigurations
    assert reconfig["restored_step"] == 10, events
    assert any("checkpoint skipped" in e and "checksum mismatch" in e for e in events), events
    assert result.steps_completed == STEPS and result.steps_redone == 14  # 11-24 again
    assert result.samples_lost == 0 and result.samples_duplicated == 0
    reference = run(manifest(tmp_path, "reference"), workers=4)
    worst = max(abs(a - b) for a, b in zip(result.losses, reference.losses))
    assert worst < 1e-4, (result.losses, reference.losses)
