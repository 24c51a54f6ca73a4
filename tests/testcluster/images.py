"""The project's container images, built (or reused) by hack/images.sh once per session.

The first build on a machine takes minutes (an engine, a Debian base, the pinned wheels, then
both images); later ones reuse what the checkout's content has already built. Where no Docker
engine can run (not root, none running), the tests that need the images skip.
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass

import pytest

from testcluster.local import REPO

IMAGES_SCRIPT = REPO / "hack" / "images.sh"
BUILD_TIMEOUT_S = 40 * 60
NO_ENGINE = 3  # hack/images.sh's exit status when no engine can run here


@dataclass(frozen=True)
class Images:
    runtime: str
    operator: str


@pytest.fixture(scope="session")
def images() -> Images:
    try:
        result = subprocess.run([str(IMAGES_SCRIPT), "build"], capture_output=True, text=True,
                                timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"hack/images.sh build did not finish in {BUILD_TIMEOUT_S} s:\n{e.stderr}") from None
    if result.returncode == NO_ENGINE:
        pytest.skip(f"no Docker engine here: {result.stderr.strip()}")
    if result.returncode != 0:
        raise RuntimeError(f"hack/images.sh build failed (exit {result.returncode}):\n{result.stderr}")
    names = dict(entry.split("=", 1) for entry in result.stdout.split())
    return Images(runtime=names["runtime"], operator=names["operator"])
