"""The environment a worker and a coordinator start with: one contract, in one module.

The operator's pod builders and the local backend write it; the node agent reads it and
adds what each of its rank processes needs (``rank_env``); the workers (the ranks) and the
coordinator read it. Nothing else spells a ``LAZARUS_*`` name: every side takes the names and the
encoding from here, so the two ends cannot drift apart.
"""
from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

from .checkpoint_location import KEEP_DEFAULT
from .job_spec import JobSpec

# --- a worker -----------------------------------------------------------------------------
COORDINATOR = "LAZARUS_COORDINATOR"  # host:port of the coordinator's store
NODE_NAME = "LAZARUS_NODE_NAME"  # the node it runs on: plans name nodes
RUNTIME = "LAZARUS_RUNTIME"  # spec.runtime as JSON
CHECKPOINT_PATH = "LAZARUS_CHECKPOINT_PATH"
CHECKPOINT_EVERY_STEPS = "LAZARUS_CHECKPOINT_EVERY_STEPS"
CHECKPOINT_KEEP = "LAZARUS_CHECKPOINT_KEEP"
# The job's UID: its checkpoints live under <checkpoint path>/<uid>, apart from any other
# job's (unset: the checkpoint path is this run's own folder, as `lazarus run` makes one).
JOB_UID = "LAZARUS_JOB_UID"
# Knobs a user may set through spec.template.env.
COLLECTIVE_TIMEOUT_S = "LAZARUS_COLLECTIVE_TIMEOUT_S"
RECONNECT_S = "LAZARUS_RECONNECT_S"  # how long to look for a replacement coordinator
LOG_LEVEL = "LAZARUS_LOG_LEVEL"
THREADS = "LAZARUS_THREADS"
# --- both: the job's name and key, which sign every message between them -------------------
JOB = "LAZARUS_JOB"
# On a cluster it comes from the job's Secret (the pod builders reference it there), never
# as a value in a pod's spec.
JOB_KEY = "LAZARUS_JOB_KEY"
# Set on worker pods for reference (kubectl describe, debugging); no process needs them.
NAMESPACE = "LAZARUS_NAMESPACE"
POD_NAME = "LAZARUS_POD_NAME"
PLAN_CONFIGMAP = "LAZARUS_PLAN_CONFIGMAP"
WORKERS_SERVICE = "LAZARUS_WORKERS_SERVICE"
# --- the node agent, and the rank processes it starts ----------------------------------------
GPUS_PER_NODE = "LAZARUS_GPUS_PER_NODE"  # rank processes a node agent starts
# The worker pod's uid: the agent's exit reports name it, so that the operator never takes
# the exits of an earlier pod on the same node for this one's (unset outside a cluster).
POD_UID = "LAZARUS_POD_UID"
# The job's collective backend. The local backend sets it for its agents, since only it sees
# that ranks of different nodes share a GPU; a pod's agent decides from its own GPUs.
BACKEND = "LAZARUS_BACKEND"
LOCAL_RANK = "LAZARUS_LOCAL_RANK"  # which of its node's ranks a process is
DEVICE = "LAZARUS_DEVICE"  # where a rank computes: cpu, or cuda (it sees only its own GPU)
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"  # CUDA's own: which GPUs a process sees
GLOO, NCCL = "gloo", "nccl"
BACKENDS = (GLOO, NCCL)
DEVICES = ("cpu", "cuda")
# --- the coordinator (besides JOB, NAMESPACE and PLAN_CONFIGMAP) ------------------------------
COORDINATOR_PORT = "LAZARUS_COORDINATOR_PORT"
STATE_CONFIGMAP = "LAZARUS_STATE_CONFIGMAP"  # its progress and durable record
STEPS = "LAZARUS_STEPS"  # a job that ends after this many steps


class EnvError(ValueError):
    """A process started without what it needs; the message names the variables."""


# 256 random bits as 64 hex digits: text, so it fits an environment variable and a Secret.
_JOB_KEY_TEXT = re.compile(r"^[0-9a-f]{64,}$")


def new_job_key() -> str:
    """A fresh job key (the local backend makes one per run; the operator one per job)."""
    return secrets.token_hex(32)


@dataclass(frozen=True)
class WorkerEnv:
    coordinator: str
    node: str
    runtime: dict
    job: str
    key: str = field(repr=False)
    checkpoint_path: str | None = None
    checkpoint_every_steps: int = 0
    checkpoint_keep: int = KEEP_DEFAULT
    job_uid: str | None = None
    collective_timeout_s: float = 60.0
    reconnect_s: float = 120.0
    log_level: str = "WARNING"
    threads: int = 1
    # Set by the node agent for each rank; a worker started alone is rank 0 on the CPU.
    local_rank: int = 0
    device: str = "cpu"
    backend: str = GLOO

    @property
    def coordinator_address(self) -> tuple[str, int]:
        return _host_port(self.coordinator)


def worker_env(spec: JobSpec, job: str, coordinator: str, node: str | None = None,
               key: str | None = None, checkpoint_path: str | None = None,
               job_uid: str | None = None) -> dict[str, str]:
    """What a worker of ``spec`` is started with. ``node`` None leaves NODE_NAME to the
    caller (a pod takes it from the downward API), ``key`` None leaves JOB_KEY to it (a pod
    takes it from the job's Secret); ``checkpoint_path`` overrides ``spec.checkpoint.path``."""
    env = {COORDINATOR: coordinator, RUNTIME: json.dumps(dict(spec.runtime), sort_keys=True),
           JOB: job, GPUS_PER_NODE: str(spec.gpus_per_node)}
    if node is not None:
        env[NODE_NAME] = node
    if key is not None:
        env[JOB_KEY] = key
    env |= _checkpoint_env(spec, checkpoint_path, job_uid)
    if spec.checkpoint and env.get(CHECKPOINT_PATH):
        env[CHECKPOINT_EVERY_STEPS] = str(spec.checkpoint.every_steps)
        env[CHECKPOINT_KEEP] = str(spec.checkpoint.keep)
    return env


def _checkpoint_env(spec: JobSpec, checkpoint_path: str | None,
                    job_uid: str | None) -> dict[str, str]:
    """Where the job's checkpoints are: what the workers write and the coordinator reads."""
    path = checkpoint_path or (spec.checkpoint.path if spec.checkpoint else None)
    env = {CHECKPOINT_PATH: path} if path else {}
    if path and job_uid:
        env[JOB_UID] = job_uid
    return env


def read_worker_env(environ: Mapping[str, str]) -> WorkerEnv:
    _require(environ, (COORDINATOR, NODE_NAME, RUNTIME, JOB, JOB_KEY),
             "a worker is started by its coordinator (`lazarus run JOB.yaml --local` starts "
             "both) or by the operator")
    try:
        runtime = json.loads(environ[RUNTIME])
        return WorkerEnv(
            coordinator=environ[COORDINATOR], node=environ[NODE_NAME], runtime=runtime,
            job=environ[JOB], key=_job_key(environ),
            checkpoint_path=environ.get(CHECKPOINT_PATH) or None,
            checkpoint_every_steps=int(environ.get(CHECKPOINT_EVERY_STEPS) or 0),
            checkpoint_keep=int(environ.get(CHECKPOINT_KEEP) or KEEP_DEFAULT),
            job_uid=environ.get(JOB_UID) or None,
            collective_timeout_s=float(environ.get(COLLECTIVE_TIMEOUT_S) or 60),
            reconnect_s=float(environ.get(RECONNECT_S) or 120),
            log_level=environ.get(LOG_LEVEL) or "WARNING",
            threads=int(environ.get(THREADS) or 1),
            local_rank=int(environ.get(LOCAL_RANK) or 0),
            device=_one_of(environ, DEVICE, DEVICES, "cpu"),
            backend=_one_of(environ, BACKEND, BACKENDS, GLOO))
    except ValueError as e:
        raise EnvError(f"malformed worker environment: {e}") from None


@dataclass(frozen=True)
class AgentEnv:
    node: str
    coordinator: str
    ranks: int
    job: str
    key: str = field(repr=False)  # it signs the exit reports of its ranks
    # None: the agent chooses from the GPUs it sees (``devices.collective_backend``).
    backend: str | None = None
    # The GPUs the agent may use, as CUDA_VISIBLE_DEVICES lists them; None: all it sees.
    visible_gpus: str | None = None
    pod_uid: str = ""

    @property
    def coordinator_address(self) -> tuple[str, int]:
        return _host_port(self.coordinator)


def read_agent_env(environ: Mapping[str, str]) -> AgentEnv:
    _require(environ, (COORDINATOR, NODE_NAME, GPUS_PER_NODE, JOB, JOB_KEY),
             "a node agent is started by the operator's worker pod or by `lazarus run --local`")
    try:
        ranks = int(environ[GPUS_PER_NODE])
        if ranks < 1:
            raise ValueError(f"{GPUS_PER_NODE} must be >= 1, got {ranks}")
        return AgentEnv(node=environ[NODE_NAME], coordinator=environ[COORDINATOR], ranks=ranks,
                        job=environ[JOB], key=_job_key(environ),
                        backend=_one_of(environ, BACKEND, BACKENDS, None),
                        visible_gpus=environ.get(CUDA_VISIBLE_DEVICES),
                        pod_uid=environ.get(POD_UID, ""))
    except ValueError as e:
        raise EnvError(f"malformed node agent environment: {e}") from None


def rank_env(local_rank: int, gpu: str | None, backend: str) -> dict[str, str]:
    """What the node agent adds to its own environment for rank ``local_rank``: its GPU
    (None: the CPU, with every GPU hidden) and the job's collective backend."""
    return {LOCAL_RANK: str(local_rank), DEVICE: "cpu" if gpu is None else "cuda",
            BACKEND: backend, CUDA_VISIBLE_DEVICES: gpu or ""}


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def _one_of(environ: Mapping[str, str], name: str, allowed: tuple[str, ...],
            default: str | None) -> str | None:
    value = environ.get(name) or default
    if value is not None and value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return value


@dataclass(frozen=True)
class CoordinatorEnv:
    job: str
    namespace: str
    plan_configmap: str
    state_configmap: str
    port: int
    key: str = field(repr=False)
    steps: int | None = None
    log_level: str = "WARNING"
    # Where the workers' checkpoints are: the coordinator picks the one to restore.
    checkpoint_path: str | None = None
    job_uid: str | None = None


def coordinator_env(job: str, namespace: str, plan_configmap: str, state_configmap: str,
                    port: int, spec: JobSpec, job_uid: str | None) -> dict[str, str]:
    env = {JOB: job, NAMESPACE: namespace, PLAN_CONFIGMAP: plan_configmap,
           STATE_CONFIGMAP: state_configmap,
           COORDINATOR_PORT: str(port)} | _checkpoint_env(spec, None, job_uid)
    if spec.steps is not None:
        env[STEPS] = str(spec.steps)
    return env


def read_coordinator_env(environ: Mapping[str, str]) -> CoordinatorEnv:
    _require(environ, (JOB, NAMESPACE, PLAN_CONFIGMAP, STATE_CONFIGMAP, COORDINATOR_PORT,
                       JOB_KEY),
             "the operator starts the coordinator pod of each LazarusJob")
    try:
        return CoordinatorEnv(
            job=environ[JOB], namespace=environ[NAMESPACE],
            plan_configmap=environ[PLAN_CONFIGMAP], state_configmap=environ[STATE_CONFIGMAP],
            port=int(environ[COORDINATOR_PORT]), key=_job_key(environ),
            steps=int(environ[STEPS]) if environ.get(STEPS) else None,
            log_level=environ.get(LOG_LEVEL) or "WARNING",
            checkpoint_path=environ.get(CHECKPOINT_PATH) or None,
            job_uid=environ.get(JOB_UID) or None)
    except ValueError as e:
        raise EnvError(f"malformed coordinator environment: {e}") from None


def check_job_key(key: str) -> str:
    """``key`` if it is a job key (64 or more lower-case hex digits), else ValueError."""
    if not _JOB_KEY_TEXT.match(key):
        raise ValueError(f"{JOB_KEY} must be 64 or more lower-case hex digits (the job's "
                         f"Secret holds one); it is {len(key)} characters of something else")
    return key


def _job_key(environ: Mapping[str, str]) -> str:
    return check_job_key(environ[JOB_KEY])


def _require(environ: Mapping[str, str], names: tuple[str, ...], why: str) -> None:
    missing = [n for n in names if not environ.get(n)]
    if missing:
        raise EnvError(f"{', '.join(missing)} not set; {why}")
