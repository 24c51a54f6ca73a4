"""The controller state of a job, rebuilt from what the API server holds.

The operator keeps the state in memory only as a cache. After a restart (or whenever
applying a decision failed) it is rebuilt from the latest published plan and the job's
status; loads and pending growth are re-learnt from the workers.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lazarus_core import controller as core
from lazarus_core.cluster_contract import read_plan_configmap
from lazarus_core.job_spec import JobSpec
from lazarus_core.topology import NodeSpec

from . import builders
from .kube_api import ObjectConflict, owned_by, owner_names
from .observe import NodeInfo

log = logging.getLogger(__name__)


def rebuild_state(api: client.CoreV1Api, body: dict, spec: JobSpec,
                  nodes: Mapping[str, NodeInfo], settings: core.Settings,
                  clock: Callable[[], float]) -> tuple[core.JobState, str | None]:
    """(state, resourceVersion of the plan ConfigMap it was built from, None if none).
    A plan ConfigMap that is not the job's own is never taken for its plan: ObjectConflict."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    status = body.get("status") or {}
    plan, version = None, None
    try:
        cm = api.read_namespaced_config_map(builders.plan_configmap_name(name), namespace)
        if not owned_by(cm.metadata, body):
            raise ObjectConflict("ConfigMap", cm.metadata.name, owner_names(cm.metadata))
        version = cm.metadata.resource_version
        plan, _ = read_plan_configmap(cm.data or {})
    except ApiException as e:
        if e.status != 404:
            raise
    except (KeyError, ValueError) as e:  # PlanError is a ValueError
        log.error("%s/%s: the plan ConfigMap is unreadable (%s); starting afresh",
                  namespace, name, e)
    members: tuple[NodeSpec, ...] = ()
    if plan is not None:
        members = tuple(
            nodes[n.name].spec(spec) if n.name in nodes else
            NodeSpec(n.name, spec.gpus_per_node, spec.slots_per_gpu, n.zone)
            for n in plan.nodes)
    step = status.get("step", 0)
    state = core.JobState(
        spec=spec, plan=plan, nodes=members, step=step,
        checkpoint_step=status.get("checkpointStep"),
        last_rebalance_step=step,
        progress_generation=plan.generation if plan is not None and step else None,
        restores=status.get("checkpointRestores", 0),
        # A stall is counted from now: how long the workers went without a step while no
        # operator ran is not known.
        progress_at=clock(),
        finished=spec.steps is not None and step >= spec.steps,
        settings=settings,
    )
    return state, version
