"""kopf handlers: small functions that translate watch events into reconcile requests.

The decisions are all in the controller core (lazarus_core.controller) and the reconciler;
a handler only says which job to look at. Handlers are sync: kopf runs them in its thread
pool, where the blocking Kubernetes client is fine.
"""
from __future__ import annotations

import logging
import time

import kopf
from kubernetes import client, config

from lazarus_core.cluster_contract import GROUP, JOB_LABEL, PLURAL, ROLE_LABEL, VERSION
from lazarus_core.controller import Settings, not_ready
from lazarus_core.job_spec import SpecError, parse_manifest
from lazarus_core.migration import preload

from . import builders
from .kube_api import rfc3339
from .reconciler import Reconciler

JOBS = f"{PLURAL}.{VERSION}.{GROUP}"
# No kopf timer or daemon on jobs: kopf puts a finalizer on every object that has one, and a
# job would then outlive an uninstalled operator (and block its namespace's deletion). The
# reconciler schedules its own retries and a periodic pass per job.


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_) -> None:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    api = client.ApiClient()
    # Pod patches and deletions fan out in parallel; the default pool of 4 would serialise them.
    api.rest_client.pool_manager.connection_pool_kw["maxsize"] = 16
    memo.reconciler = Reconciler(api, Settings(start_grace_s=memo.get("start_grace_s", 10.0),
                                               stall_s=memo.get("stall_s", 0.0)),
                                 coordinator_port=memo.get("coordinator_port",
                                                           builders.COORDINATOR_PORT))
    # kopf posts an Event per handler log line at INFO; only its warnings and errors (a
    # permanently invalid spec) are worth one. The reconciler posts the reconfigurations.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    # A standby replica takes over once the active one misses its keep-alives for this long
    # (kopf's default is 60 s, a long time for a job whose nodes are being reclaimed).
    settings.peering.lifetime = 15
    preload()  # not on the first re-plan's critical path


@kopf.on.create(JOBS)
@kopf.on.update(JOBS)
@kopf.on.resume(JOBS)
def job_spec_changed(body: kopf.Body, name: str, namespace: str, status: kopf.Status,
                     meta: kopf.Meta, patch: kopf.Patch, memo: kopf.Memo, **_) -> None:
    """Check the spec (and the name), then reconcile. A job the schema let through but that
    can never run gets a Ready=False condition naming the field and the fix, once: one
    status patch and one Event, no retries, and nothing created, until the spec changes."""
    try:
        parse_manifest(body)
    except SpecError as e:
        patch.status["conditions"] = not_ready(
            list(status.get("conditions") or []), e.reason, str(e), rfc3339(time.time()),
            meta.get("generation"))
        patch.status["observedGeneration"] = meta.get("generation")
        raise kopf.PermanentError(str(e))
    memo.reconciler.request(namespace, name)


@kopf.on.event(JOBS)
def job_event(event: kopf.RawEvent, name: str, namespace: str, memo: kopf.Memo, **_) -> None:
    if event["type"] == "DELETED":
        # Owner references take the pods, the plan ConfigMap and the Service with it.
        memo.reconciler.forget(namespace, name)


@kopf.on.event("pods", labels={JOB_LABEL: kopf.PRESENT, ROLE_LABEL: kopf.PRESENT})
def job_pod_event(event: kopf.RawEvent, labels: kopf.Labels, namespace: str,
                  memo: kopf.Memo, **_) -> None:
    """A worker or the coordinator: deleted, failed, evicted, scheduled, running, or a
    DisruptionTarget condition."""
    if memo.reconciler.pod_changed(event["object"], deleted=event["type"] == "DELETED"):
        memo.reconciler.request(namespace, labels[JOB_LABEL])


@kopf.on.event("configmaps", labels={JOB_LABEL: kopf.PRESENT, ROLE_LABEL: "state"})
def job_state_event(event: kopf.RawEvent, labels: kopf.Labels, namespace: str,
                    memo: kopf.Memo, **_) -> None:
    """The coordinator's progress report, or workers it found lost."""
    if memo.reconciler.state_changed(event["object"], deleted=event["type"] == "DELETED"):
        memo.reconciler.request(namespace, labels[JOB_LABEL])


@kopf.on.event("nodes")
def node_event(event: kopf.RawEvent, name: str, memo: kopf.Memo, **_) -> None:
    """Deleted, NotReady, or tainted with a spot notice: re-plan the jobs that run there."""
    body = None if event["type"] == "DELETED" else event["object"]
    for namespace, job in memo.reconciler.node_changed(body, name):
        memo.reconciler.request_settled(namespace, job)

