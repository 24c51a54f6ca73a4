"""Running the local backend from tests: a manifest with overrides, results cached per run."""
from __future__ import annotations

import copy
from pathlib import Path

import yaml
from lazarus_core.job_spec import parse_manifest

from lazarus_runtime.local_backend import Fault, LocalJob, RunResult

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"
STEPS = 30


def manifest(tmp: Path, name: str, **spec_overrides) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc = copy.deepcopy(doc)
    doc["metadata"]["name"] = name
    doc["spec"]["rebalanceEverySteps"] = 0  # only the rebalancing test wants it
    doc["spec"].update(spec_overrides)
    doc["spec"]["checkpoint"] = {"path": str(tmp / "ckpt"), "everySteps": 10}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def run(path: Path, workers: int, kills=(), joins=(), steps: int = STEPS,
        events: list | None = None, job_class: type[LocalJob] = LocalJob,
        **options) -> RunResult:
    """``options``: further LocalJob arguments (kill_every_s, duration_s, ...)."""
    name, spec = parse_manifest(yaml.safe_load(path.read_text()))
    job = job_class(name, spec, workers, steps, list(kills), list(joins),
                   checkpoint_dir=path.parent / "ckpt" / name,
                   on_event=(events.append if events is not None else lambda line: None),
                   timeout_s=240, **options)
    return job.run()


__all__ = ["Fault", "manifest", "run", "STEPS"]
