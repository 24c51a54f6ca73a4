"""`lazarus run`: it refuses bad manifests and flags before it starts any worker, and runs a
job of several ranks per node from the Python that runs it (``python -m lazarus_cli``)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml")


def lazarus(*args):
    return subprocess.run([sys.executable, "-m", "lazarus_cli", "run", *args],
                          capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("args,field", [
    ([EXAMPLE, "--local", "--workers", "9"], "--workers"),
    ([EXAMPLE, "--local", "--workers", "1"], "--workers"),
    ([EXAMPLE, "--local", "--steps", "0"], "--steps"),
    ([EXAMPLE, "--local", "--kill", "0:1"], "--kill"),
    ([EXAMPLE, "--local", "--kill", "5:worker-7"], "--kill"),
    ([EXAMPLE, "--local", "--kill", "5:worker-1/1"], "--kill"),  # gpusPerNode: 1
    ([EXAMPLE, "--local", "--kill", "50:1", "--steps", "10"], "--kill"),
    ([EXAMPLE, "--local", "--join", "1:1"], "--join"),
    ([EXAMPLE, "--local", "--workers", "0"], "--workers"),  # was taken as no --workers
    # Beyond spec.maxNodes (4): this started workers by the hundred before.
    ([EXAMPLE, "--local", "--join", "5:100000"], "--join: 100004 workers would be alive"),
    ([EXAMPLE, "--local", "--kill", "3:1", "--join", "5:2"], "--join: 5 workers"),
    ([EXAMPLE, "--local", "--join", "50:1", "--steps", "10"], "--join: every STEP"),
    ([EXAMPLE], "--local"),
    (["/nonexistent.yaml", "--local"], "nonexistent"),
])
def test_bad_flags_exit_2_with_one_line(args, field):
    out = lazarus(*args)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in out.stderr


@pytest.mark.parametrize("good, bad, field", [
    ("minReplicas: 2", "minReplicas: 0", "spec.minReplicas"),
    # The CRD refuses these too: `lazarus run` holds a manifest to the same rules.
    ("topK: 2", "topK: 3", "spec.runtime.topK"),
    ("cpu: 500m", "cpu: lots", "spec.template.resources.requests[cpu]"),
    ("name: tiny", "name: 1tiny", "metadata.name"),
    ('learningRate: "0.003"', "learningRate: 0.003", "spec.runtime.learningRate"),
])
def test_a_bad_manifest_names_the_field(tmp_path, good, bad, field):
    manifest = Path(EXAMPLE).read_text()
    assert good in manifest
    path = tmp_path / "job.yaml"
    path.write_text(manifest.replace(good, bad))
    out = lazarus(str(path), "--local")
    assert out.returncode == 2
    assert field in out.stderr and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_two_ranks_per_node_train_and_a_killed_rank_costs_nothing(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(Path(EXAMPLE).read_text()
                   .replace("gpusPerNode: 1", "gpusPerNode: 2")
                   .replace("/tmp/lazarus/tiny", str(tmp_path / "ckpt")))
    summary = tmp_path / "summary.json"
    out = lazarus(str(job), "--local", "--workers", "2", "--steps", "12",
                  "--kill", "6:worker-1/1", "--summary-json", str(summary))
    assert out.returncode == 0, out.stderr
    assert "generation 1 (Initial): 2 workers (4 ranks)" in out.stderr, out.stderr
    result = json.loads(summary.read_text())
    assert result["steps_completed"] == 12 and result["samples_lost"] == 0
    assert [r["reason"] for r in result["reconfigurations"]] == ["GpuLost"]
    assert result["workers"] == 3  # ranks left: two on worker-0, one on worker-1
