"""benchmarks/bench_train_step.py runs on a CPU with the tiny model, so CI keeps it working."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_training_step_benchmark_runs_on_a_cpu(tmp_path):
    table = tmp_path / "train.json"
    run = subprocess.run(
        [sys.executable, "benchmarks/bench_train_step.py", "--device", "cpu", "--models", "tiny",
         "--tokens", "256", "--warmup", "1", "--steps", "2", "--compile", "dense",
         "--json", str(table)],
        cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True,
        timeout=840)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {r["impl"]: r for r in json.loads(table.read_text())}
    assert set(rows) == {"lazarus", "lazarus compile=dense", "plain eager", "plain compiled"}
    for row in rows.values():
        assert row["tokens"] == 256 and row["seconds"] > 0 and row["tflops"] > 0
        assert row["peak_bytes"] > 0
    # The engine reads the loss and the loads back once a step; the plain step never reads
    # its loss.
    assert rows["lazarus"]["host_syncs"] == 1
    assert rows["plain eager"]["host_syncs"] == 0
    assert rows["plain compiled"]["per_compiled"] == 1.0
    assert "lazarus compile=dense" in run.stdout
