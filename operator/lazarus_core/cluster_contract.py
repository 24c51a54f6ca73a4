"""Names shared by the operator and the runtime on Kubernetes.

The operator publishes plans in a ConfigMap and reads progress from a pod annotation; the
coordinator reads the one and writes the other. Both sides take the keys from here, and
both backends (worker pods, local processes) give workers the same ``training_env``.
"""
from __future__ import annotations

import json
import secrets

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
# The job's key, which signs every message between the coordinator and the workers: the
# variable the job's pods read it from, and the key of the job's Secret that holds it.
JOB_KEY_ENV = "LAZARUS_JOB_KEY"
JOB_KEY_SECRET_KEY = "key"


def new_job_key() -> str:
    """A fresh job key: 256 random bits as 64 hex digits (text, so it fits an environment
    variable and a Secret as it is)."""
    return secrets.token_hex(32)


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
