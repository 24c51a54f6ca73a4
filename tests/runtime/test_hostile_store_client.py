"""A process without the job's key reaches the job's store while it trains: it writes stops,
forges and replays commits, directives, reports and checkpoints, bumps counters and deletes
keys, over and over (tests/hostile_store_client.py). The job trains on to the end and
computes what it computes without it: the same loss at every step, no sample lost or seen
twice."""
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from lazarus_core.job_spec import parse_manifest

from elastic_jobs import STEPS, manifest
from lazarus_runtime.local_backend import LocalJob

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4

# tests/hostile_store_client.py: the attacker, as a process of its own.
ATTACKER = Path(__file__).resolve().parents[1] / "hostile_store_client.py"


def run_job(path, attack: bool):
    name, spec = parse_manifest(yaml.safe_load(path.read_text()))
    job = LocalJob(name, spec, 2, STEPS, checkpoint_dir=path.parent / "ckpt" / name,
                   timeout_s=240)
    result: list = []
    runner = threading.Thread(target=lambda: result.append(job.run()))
    runner.start()
    attacker = None
    if attack:
        deadline = time.monotonic() + 60
        while job.store is None and time.monotonic() < deadline:
            time.sleep(0.01)
        attacker = subprocess.Popen(
            [sys.executable, str(ATTACKER), f"127.0.0.1:{job.store.port}"],
            stdout=subprocess.PIPE, text=True)
    runner.join(timeout=300)
    rounds = 0
    if attacker is not None:
        attacker.kill()
        rounds = len(attacker.communicate()[0].split())
    assert result, "the job did not finish"
    return result[0], job, rounds


def test_a_hostile_store_client_changes_nothing(tmp_path):
    reference, _, _ = run_job(manifest(tmp_path, "reference"), attack=False)
    result, job, rounds = run_job(manifest(tmp_path, "attacked"), attack=True)

    assert rounds >= 5, "the attacker must have had time to do its worst"
    assert result.steps_completed == STEPS and result.generation == 1
    assert result.samples_lost == 0 and result.samples_duplicated == 0
    worst = max(abs(a - b) for a, b in zip(result.losses, reference.losses))
    assert worst < TOLERANCE, (result.losses, reference.losses)
    # The coordinator saw the forgeries and dropped them (the workers did too, in their logs).
    assert job.chan.rejected > 0
