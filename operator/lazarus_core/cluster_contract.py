"""Names shared by the operator and the runtime on Kubernetes, and the encodings of what
they exchange through the API server.

Two ConfigMaps per job, both owned by the job, each written by one side only: the plan
(the operator publishes each generation; the coordinator follows it) and the job's state
(the coordinator writes its progress report, which is also its durable record, and the
workers it found lost before Kubernetes did; the operator reads both, and a replacement
coordinator starts from it). Both sides take the names from here, and encode and decode
the data with the functions below. (The processes' environment is the other contract:
``process_env``.)
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .controller import Progress
from .plan import Plan
from .job_spec import API_VERSION, KIND  # noqa: F401 (the manifest's identity, defined there)

GROUP, VERSION = API_VERSION.split("/")
PLURAL = "lazarusjobs"
JOB_LABEL = f"{GROUP}/job"
ROLE_LABEL = f"{GROUP}/role"
# The plan ConfigMap's keys: the latest generation, and the nodes out of it that still send
# experts away (spot notice).
PLAN_KEY = "plan.json"
DRAINING_KEY = "draining.json"
# The state ConfigMap's keys: the latest progress report, and the rank processes the
# coordinator declared lost (exited, no heartbeat, a hung loop), each with the reason.
PROGRESS_KEY = "progress.json"
SUSPECTS_KEY = "suspects.json"
# How a reason in suspects.json starts when the rank's node agent saw it exit: such a rank
# failed for good (its agent ends the pod once every rank has), while a silent one may beat
# again. The reason also names the agent's pod: until a new pod's rank says hello, the
# coordinator still shows the exit of the pod before it on the same node.
_EXITED = "its process exited with status "
_IN_POD, _SAYS, _LOCALLY = " (its node agent in pod ", " says)", " (its node agent says)"


@dataclass(frozen=True)
class ExitReport:
    """A rank exit, as the operator reads it from suspects.json."""
    pod_uid: str  # the pod whose agent saw it ("" outside a cluster)
    message: str  # its status and last words


def plan_configmap_name(job: str) -> str:
    return f"{job}-plan"


def state_configmap_name(job: str) -> str:
    return f"{job}-state"


def plan_configmap_data(plan: Plan, draining: Iterable[str] = ()) -> dict[str, str]:
    """The published plan, and the nodes out of it whose workers still hold experts to
    send (spot notice).

    The plan goes compressed (``Plan.to_compact_json``): a plan for thousands of GPUs is
    megabytes of JSON, and a ConfigMap holds at most 1 MiB. ``read_plan_configmap`` (and
    ``Plan.from_json``) read it back.
    """
    return {PLAN_KEY: plan.to_compact_json(), DRAINING_KEY: json.dumps(sorted(draining))}


def read_plan_configmap(data: Mapping[str, str]) -> tuple[Plan, frozenset[str]]:
    """(plan, draining nodes); PlanError, KeyError or ValueError when it is unreadable."""
    return Plan.from_json(data[PLAN_KEY]), frozenset(json.loads(data.get(DRAINING_KEY, "[]")))


def state_configmap_data(progress: Progress | None,
                         suspects: Mapping[str, str]) -> dict[str, str]:
    data = {SUSPECTS_KEY: json.dumps(dict(sorted(suspects.items())))}
    if progress is not None:
        data[PROGRESS_KEY] = progress_json(progress)
    return data


def exit_reason(status: int, last_words: str, pod_uid: str) -> str:
    """Why the coordinator finds a rank lost whose node agent (in the pod ``pod_uid``, ""
    outside a cluster) saw it exit."""
    return f"{_EXITED}{status}" + (f": {last_words}" if last_words else "") \
        + (f"{_IN_POD}{pod_uid}{_SAYS}" if pod_uid else _LOCALLY)


def exit_of(reason: str) -> ExitReport | None:
    """The exit a suspect's ``reason`` reports; None when the rank was found lost otherwise
    (silent, hung)."""
    if not (reason.startswith(_EXITED) and reason.endswith(_SAYS)):
        return None
    if reason.endswith(_LOCALLY):
        said, pod_uid = reason[:-len(_LOCALLY)], ""
    else:  # the last words come first, so the pod is the last one named
        said, _, pod_uid = reason[:-len(_SAYS)].rpartition(_IN_POD)
    return ExitReport(pod_uid, "exit status " + said[len(_EXITED):])


def read_state_configmap(data: Mapping[str, str] | None) -> tuple[Progress | None, dict[str, str]]:
    """(progress, suspects): anything malformed reads as absent (a coordinator bug must not
    stop the job; the next report counts)."""
    data = data or {}
    progress = read_progress(data[PROGRESS_KEY]) if data.get(PROGRESS_KEY) else None
    try:
        suspects = json.loads(data.get(SUSPECTS_KEY) or "{}")
        if not isinstance(suspects, dict):
            raise ValueError
        suspects = {str(k): str(v) for k, v in suspects.items()}
    except ValueError:
        suspects = {}
    return progress, suspects


def progress_json(p: Progress) -> str:
    return json.dumps({
        "step": p.step, "generation": p.generation,
        "loads": [list(layer) for layer in p.loads] if p.loads is not None else None,
        "checkpointStep": p.checkpoint_step, "expertsMigrated": p.experts_migrated,
        "restoredStep": p.restored_step, "expertsLost": p.experts_lost,
        "restores": p.restores, "checkpointError": p.checkpoint_error,
        "checkpointFailures": p.checkpoint_failures,
    }, separators=(",", ":"))


def read_progress(raw: str) -> Progress | None:
    """The report in ``raw``, or None when it is malformed: a coordinator bug must not stop
    the job; the report is ignored and the next one counts."""
    try:
        d = json.loads(raw)
        loads = d.get("loads")
        optional = lambda key: int(d[key]) if d.get(key) is not None else None  # noqa: E731
        return Progress(
            step=int(d["step"]), generation=int(d["generation"]),
            loads=tuple(tuple(int(t) for t in layer) for layer in loads) if loads else None,
            checkpoint_step=optional("checkpointStep"),
            experts_migrated=int(d.get("expertsMigrated") or 0),
            restored_step=optional("restoredStep"),
            experts_lost=int(d.get("expertsLost") or 0),
            restores=int(d.get("restores") or 0),
            checkpoint_error=str(d["checkpointError"]) if d.get("checkpointError") else None,
            checkpoint_failures=int(d.get("checkpointFailures") or 0))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
