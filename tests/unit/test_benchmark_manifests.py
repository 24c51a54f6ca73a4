"""The cluster benchmark's LazarusJob must pass the job validator: a stricter rule (issue
16's one sample per rank) once made bench_operator_replan.py wait 15 minutes for a job the
operator had refused, and no test noticed."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lazarus_core.job_spec import parse_manifest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_operator_replan  # noqa: E402


@pytest.mark.parametrize("nodes", [512, 1024])
def test_the_operator_benchmark_job_is_valid_at_its_sizes(nodes):
    _, spec = parse_manifest(bench_operator_replan._job("bench-ns", nodes))
    assert spec.max_nodes == nodes
