"""The job's status as the controller sees it: counts, recovery probability and conditions.

Conditions report what happened, as the workers' coordinator measured it (replicas moved,
checkpoint restored), not what the controller forecast when it published a plan.
"""
from __future__ import annotations

from collections.abc import Sequence

from .publishing import usable
from .reasons import SUCCEEDED
from .state import JobState


def lowest_replicas(state: JobState) -> int | None:
    """The fewest live replicas any expert of any layer has under the current plan."""
    if state.plan is None:
        return None
    alive = state.alive - state.noticed
    lowest = None
    for layer in state.plan.layers:
        counts = [0] * state.plan.experts
        for node, slots in zip(state.plan.nodes, layer.placement):
            if node.name in alive:
                for e in slots:
                    counts[e] += 1
        lowest = min(counts) if lowest is None else min(lowest, min(counts))
    return lowest


def status(state: JobState, previous: Sequence[dict], now_iso: str,
           observed_generation: int | None = None) -> dict:
    """The LazarusJob ``status`` (minus backend-specific fields) for this state.

    ``previous`` are the current conditions: a condition whose status is unchanged keeps
    its lastTransitionTime, as the API conventions ask.
    """
    plan = state.plan
    ready_nodes = (sum(1 for n in plan.nodes if n.name in state.alive) if plan else 0)
    out = {
        "readyNodes": ready_nodes,
        "targetNodes": state.spec.target_nodes,
        "generation": plan.generation if plan else 0,
        "step": state.step,
        "checkpointRestores": state.restores,
    }
    if state.checkpoint_step is not None:
        out["checkpointStep"] = state.checkpoint_step
    lowest = lowest_replicas(state)
    if lowest is not None:
        out["lowestReplicas"] = lowest
    if plan and plan.recovery:
        # Percent strings: status stays float-free like the spec, and reads well in kubectl.
        out["recovery"] = {k: _percent(p) for k, p in plan.recovery.items()}
        k = "2" if "2" in plan.recovery else max(plan.recovery, key=int)
        out["recoveryProbability"] = f"{_percent(plan.recovery[k])} (k={k})"
    out["conditions"] = conditions(state, previous, now_iso, observed_generation)
    return out


def _checkpoint_health(state: JobState) -> tuple[str, str, str]:
    """Whether the latest checkpoint was written, as the workers reported it."""
    ck = state.spec.checkpoint
    if state.checkpoint_error is not None:
        newest = (f"the newest complete one is step {state.checkpoint_step}"
                  if state.checkpoint_step is not None else "no checkpoint is complete yet")
        return ("False", "CheckpointWriteFailed",
                f"{state.checkpoint_error}. Training goes on; {newest}. Check that "
                f"spec.checkpoint.path ({ck.path}) is writable"
                + (f" with the credentials of Secret {ck.secret_name}" if ck.secret_name
                   else "") + f" ({state.checkpoint_failures} checkpoints skipped so far)")
    if state.checkpoint_step is not None:
        return ("True", "CheckpointWritten",
                f"the checkpoint of step {state.checkpoint_step} was written to {ck.path}")
    return ("Unknown", "NoCheckpointYet",
            f"the first checkpoint is due at step {ck.every_steps}")


def _percent(p: float) -> str:
    return f"{100 * p:.1f}%"


def not_ready(previous: Sequence[dict], reason: str, message: str, now_iso: str,
              observed_generation: int | None = None) -> list[dict]:
    """The conditions with Ready=False for ``reason``, the others kept: a job that cannot
    run as it is (an invalid spec, a name taken by an object that is not the job's)."""
    kept = [c for c in previous if c.get("type") != "Ready"]
    prev = next((c for c in previous if c.get("type") == "Ready"), None)
    since = (prev["lastTransitionTime"] if prev and prev.get("status") == "False"
             and prev.get("lastTransitionTime") else now_iso)
    # The CRD bounds a message at 32768 characters; a spec with many violations is cut.
    ready = {"type": "Ready", "status": "False", "reason": reason, "message": message[:4096],
             "lastTransitionTime": since}
    if observed_generation is not None:
        ready["observedGeneration"] = observed_generation
    return [ready, *kept]


def conditions(state: JobState, previous: Sequence[dict], now_iso: str,
               observed_generation: int | None = None) -> list[dict]:
    plan = state.plan
    spec = state.spec
    up = len(usable(state))
    if state.finished:
        ready = ("False", SUCCEEDED,
                 f"trained {state.step} steps (spec.steps is {spec.steps}); the workers "
                 f"have stopped")
    elif state.start_failures and (plan is None or state.stale):
        ready = ("False", "WorkerStartFailed",
                 f"{state.start_failures} worker(s) in a row failed before completing a "
                 f"step; the last one: {state.start_error}. New workers start with an "
                 f"exponential backoff (at most {state.settings.start_backoff_max_s:.0f} s "
                 f"apart); fix what it names (often spec.runtime or spec.template)")
    elif plan is None:
        ready = ("False", "WaitingForNodes",
                 f"{up} of {spec.fewest_nodes} needed nodes have a running worker; "
                 f"no plan is published yet")
    elif state.stale:
        ready = ("False", "WaitingForNodes",
                 f"generation {plan.generation} names a lost node and only {up} usable "
                 f"nodes remain of the {spec.fewest_nodes} the job needs; add capacity or "
                 f"lower spec.minNodes")
    else:
        ready = ("True", "Running",
                 f"generation {plan.generation} runs on {len(plan.nodes)} of "
                 f"{spec.target_nodes} target nodes")
    if plan is None:
        reconf = ("False", "NotStarted", "no plan generation has been published yet")
    elif state.progress_generation == plan.generation:
        reconf = ("True", plan.reason,
                  f"generation {plan.generation} ({plan.reason}): the workers adopted it and "
                  f"fetched {state.experts_migrated} expert replicas from their peers")
    else:
        reconf = ("True", plan.reason,
                  f"generation {plan.generation} ({plan.reason}) is published; the workers "
                  f"have not completed a step under it yet")
    if state.restored_step is not None:
        restore = ("True", "ExpertsLost",
                   f"generation {state.progress_generation}: {state.experts_lost} (layer, "
                   f"expert) pairs had lost every replica; the workers restored the "
                   f"checkpoint of step {state.restored_step} ({state.restores} restores "
                   f"so far)")
    else:
        restore = ("False", "AllExpertsSurvived",
                   "every expert kept a live replica through the latest reconfiguration")
    wanted = {"Ready": ready, "Reconfigured": reconf, "CheckpointRestored": restore}
    if spec.checkpoint is not None:
        wanted["CheckpointHealthy"] = _checkpoint_health(state)
    before = {c.get("type"): c for c in previous}
    out = []
    for ctype, (status_, reason, message) in wanted.items():
        prev = before.get(ctype)
        since = prev["lastTransitionTime"] if prev and prev.get("status") == status_ \
            and prev.get("lastTransitionTime") else now_iso
        cond = {"type": ctype, "status": status_, "reason": reason, "message": message,
                "lastTransitionTime": since}
        if observed_generation is not None:
            cond["observedGeneration"] = observed_generation
        out.append(cond)
    return out
