"""`lazarus run` refuses bad manifests and flags before it starts any worker."""
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml")


def lazarus(*args):
    return subprocess.run([sys.executable, "-m", "lazarus_cli.main", "run", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args,field", [
    ([EXAMPLE, "--local", "--workers", "9"], "--workers"),
    ([EXAMPLE, "--local", "--workers", "1"], "--workers"),
    ([EXAMPLE, "--local", "--steps", "0"], "--steps"),
    ([EXAMPLE, "--local", "--kill", "0:1"], "--kill"),
    ([EXAMPLE, "--local", "--kill", "5:worker-7"], "--kill"),
    ([EXAMPLE, "--local", "--kill", "50:1", "--steps", "10"], "--kill"),
    ([EXAMPLE, "--local", "--join", "1:1"], "--join"),
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
