"""Storage faults never stop training: real worker processes checkpointing to a folder that
refuses writes for a while."""
import pytest

from elastic_jobs import STEPS, manifest, run
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
