"""Names shared by the operator and the runtime on Kubernetes.

The operator publishes plans in a ConfigMap and reads progress from a pod annotation; the
coordinator reads the one and writes the other. Both sides take the keys from here, and
both backends (worker pods, local processes) give workers the same ``training_env``.
"""
from __future__ import annotations

import json

from .job_spec import JobSpec

GROUP = "lazarus.dev"
JOB_LABEL = f"{GROUP}/job"
ROLE_LABEL = f"{GROUP}/role"
# The plan ConfigMap's keys: the latest generation, the nodes out of it that still send
# experts away (spot notice), and the checkpoint to restore when experts were lost.
PLAN_KEY = "plan.json"
DRAINING_KEY = "draining.json"
RESTORE_KEY = "restore.json"
# JSON {step, generation, loads, checkpointStep} on the pod of rank 0.
PROGRESS_ANNOTATION = f"{GROUP}/progress"


def training_env(spec: JobSpec, checkpoint_path: str | None = None) -> dict[str, str]:
    """What a worker reads to train (lazarus_runtime.worker.main), besides its coordinator
    and its node: ``spec.runtime`` and the checkpoints (``checkpoint_path`` overrides
    ``spec.checkpoint.path``)."""
    env = {"LAZARUS_RUNTIME": json.dumps(dict(spec.runtime), sort_keys=True)}
    path = checkpoint_path or (spec.checkpoint.path if spec.checkpoint else None)
    if path:
        env["LAZARUS_CHECKPOINT_PATH"] = path
        env["LAZARUS_CHECKPOINT_EVERY_STEPS"] = str(
            spec.checkpoint.every_steps if spec.checkpoint else 0)
    return env
