"""The checkpoint-restart baseline of the goodput benchmark (``RestartingLocalJob``): after a
death every worker restarts and the job goes on from the last checkpoint. The restore must be
exact, or the benchmark would compare Lazarus with a baseline that trains a different model.
"""
import pytest

from elastic_jobs import STEPS, Fault, manifest, run
from lazarus_runtime.restart_baseline import RestartingLocalJob

pytestmark = pytest.mark.slow


def test_a_restart_from_the_checkpoint_trains_the_same_model(tmp_path):
    reference = run(manifest(tmp_path, "reference"), workers=3)
    events = []
    result = run(manifest(tmp_path, "restart"), workers=4, kills=[Fault(15, count=1)],
                 events=events, job_class=RestartingLocalJob)
    (reconfig,) = result.reconfigurations
    assert reconfig["restored_step"] == 10 and result.checkpoint_restores == 1
    assert result.steps_redone == 4  # steps 11-14 ran again from the step-10 state
    assert result.workers == 3  # the dead worker is not replaced
    assert any("restarted 3 workers" in e for e in events)
    assert len(result.losses) == STEPS
    worst = max(abs(a - b) for a, b in zip(result.losses, reference.losses))
    assert worst < 1e-4, (worst, result.losses, reference.losses)
    assert result.samples_lost == 0 and result.samples_duplicated == 0
