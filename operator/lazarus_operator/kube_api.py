"""The few ways the operator talks to the API server, each with its error handling once."""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from datetime import datetime, timezone

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from . import builders

log = logging.getLogger(__name__)
# Objects per page where a list is read a page at a time (list_json_pages).
LIST_PAGE = 250


def rfc3339(t: float) -> str:
    """Seconds since the epoch as the API's timestamps want them."""
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def list_json_pages(fn, *args, limit: int = LIST_PAGE, **kwargs) -> Iterator[list[dict]]:
    """A list call's items as raw JSON (the client's model deserialisation costs seconds for
    a thousand pods), a page at a time, so that a caller keeping a little of each object
    never holds the whole list: 2,000 nodes are 36 MB of Python objects at once."""
    token = None
    while True:
        page = json.loads(fn(*args, _preload_content=False, limit=limit,
                             **({"_continue": token} if token else {}), **kwargs).data)
        yield page["items"]
        token = (page.get("metadata") or {}).get("continue")
        if not token:
            return


def ignore_missing(fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except ApiException as e:
        if e.status != 404:
            raise


class ObjectConflict(Exception):
    """An object has a name the job needs and is not the job's (by owner UID, not labels,
    which anyone who may create it can copy): it is neither adopted nor replaced."""

    def __init__(self, kind: str, name: str, owners: list[str]):
        self.kind, self.name = kind, name
        held = f"owned by {', '.join(owners)}" if owners else "owned by nothing"
        super().__init__(f"a {kind} named {name} already exists and is not this job's "
                         f"({held}); delete it, or create the job under another name")


def owned_by(meta, owner: dict) -> bool:
    """Whether an object's metadata (a client model or a dict) names ``owner`` (a job's
    body) among its owners, by UID."""
    refs = (meta.get("ownerReferences") if isinstance(meta, dict)
            else meta.owner_references) or []
    uid = owner["metadata"]["uid"]
    return any((r.get("uid") if isinstance(r, dict) else r.uid) == uid for r in refs)


def owner_names(meta) -> list[str]:
    refs = (meta.get("ownerReferences") if isinstance(meta, dict)
            else meta.owner_references) or []
    return [f"{r.get('kind')} {r.get('name')}" if isinstance(r, dict) else f"{r.kind} {r.name}"
            for r in refs]


def create_owned(owner: dict, create: Callable, read: Callable, obj: dict) -> None:
    """Create ``obj`` owned by ``owner``. If its name is taken, the object is kept only when
    it is ``owner``'s (made by a pass before a restart); else ObjectConflict."""
    kopf.adopt(obj, owner=owner)
    meta = obj["metadata"]
    try:
        create(meta["namespace"], obj)
    except ApiException as e:
        if e.status != 409:
            raise
        existing = read(meta["name"], meta["namespace"]).metadata
        if not owned_by(existing, owner):
            raise ObjectConflict(obj["kind"], meta["name"], owner_names(existing)) from None


def delete_pods(core: client.CoreV1Api, pool: Executor, pods: list[tuple[str, bool]],
                namespace: str) -> None:
    """Delete ``(name, force)`` pods in parallel. No kubelet will confirm deleting a pod on a
    vanished or dead node: those are forced, so that the name and the place in the count
    are free at once."""
    def delete(item):
        pod, force = item
        ignore_missing(core.delete_namespaced_pod, pod, namespace,
                       grace_period_seconds=0 if force else None)
    list(pool.map(delete, pods))


def post_event(core: client.CoreV1Api, body: dict, reason: str, message: str, kind: str,
               suffix: str, now: float) -> None:
    """One Event per (job, suffix): a retried pass does not post it twice."""
    meta = body["metadata"]
    ref = {"name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"]}
    name = f"{meta['name']}.{meta['uid'][:8]}.{suffix}"
    event = builders.build_event(ref, reason, message, kind, rfc3339(now), name)
    try:
        core.create_namespaced_event(meta["namespace"], event)
    except ApiException as e:
        if e.status != 409:
            log.warning("could not post event %s: %s", reason, e.reason)


def write_plan(core: client.CoreV1Api, cm: dict, version: str | None) -> str:
    """Write the plan ConfigMap only over ``version`` (None: create it); its new version.

    If anyone else wrote it meanwhile (a replica that was active while this one was paused,
    or one still stopping), the write fails with a conflict, the pass is abandoned and the
    next one rebuilds from the ConfigMap: two operators can never publish two different
    plans under one generation number."""
    meta = cm["metadata"]
    if version is None:
        written = core.create_namespaced_config_map(meta["namespace"], cm)
    else:
        meta["resourceVersion"] = version
        written = core.replace_namespaced_config_map(meta["name"], meta["namespace"], cm)
    return written.metadata.resource_version
