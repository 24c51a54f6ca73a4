"""The requirements an image installs, read from pyproject.toml, the one source of pins.

    python3 images/pins.py [--build-system] EXTRA...

prints one requirement a line: the project's own dependencies, then those of each extra, and
with ``--build-system`` what builds the project's wheel. The Dockerfiles install exactly these
(hack/images.sh downloads them into its wheelhouse), so an image cannot drift from the pins
the tests run against. Standard library only: it runs on the image's bare Python.
"""
from __future__ import annotations

import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def requirements(extras: list[str], build_system: bool = False,
                 pyproject: Path = PYPROJECT) -> list[str]:
    doc = tomllib.loads(pyproject.read_text())
    project = doc["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"pins.py: no extra {unknown} in {pyproject}; "
                         f"it declares {sorted(optional)}")
    lines = list(project.get("dependencies", []))
    for extra in extras:
        lines += optional[extra]
    if build_system:
        lines += doc["build-system"]["requires"]
    return list(dict.fromkeys(lines))


def main(argv: list[str]) -> int:
    build_system = "--build-system" in argv
    print("\n".join(requirements([a for a in argv if a != "--build-system"], build_system)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
