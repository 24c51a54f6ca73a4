"""Kubernetes API clients for a given kubeconfig, and small helpers the tests share."""
from __future__ import annotations

from kubernetes import client, config

POD_TOKEN_TTL_S = 3600


def api_client(kubeconfig: str, *, impersonate: str | None = None) -> client.ApiClient:
    """An API client for ``kubeconfig``; with ``impersonate``, every request acts as that user
    (for example ``system:serviceaccount:ns:name``), which is how RBAC is checked."""
    api = config.new_client_from_config(config_file=str(kubeconfig))
    if impersonate:
        api.set_default_header("Impersonate-User", impersonate)
    return api


def core_v1(kubeconfig: str) -> client.CoreV1Api:
    return client.CoreV1Api(api_client(kubeconfig))


def token_client(kubeconfig: str, token: str) -> client.ApiClient:
    """An API client that reaches the same server as ``kubeconfig`` but authenticates with a
    bearer token only (a ServiceAccount token), not with the admin's client certificate."""
    admin = api_client(kubeconfig).configuration
    conf = client.Configuration()
    conf.host = admin.host
    conf.ssl_ca_cert = admin.ssl_ca_cert
    conf.verify_ssl = admin.verify_ssl
    conf.api_key = {"authorization": f"Bearer {token}"}
    return client.ApiClient(conf)


def status_of(call) -> int:
    """The HTTP status a call answers with (200 when it succeeds): how RBAC tests read a
    request's fate."""
    try:
        call()
    except client.ApiException as e:
        return e.status
    return 200


def pod_token(core: client.CoreV1Api, pod: client.V1Pod, ttl_s: int = POD_TOKEN_TTL_S,
              audience: str | None = None) -> str:
    """A token of the pod's ServiceAccount bound to the pod, as the kubelet mounts one: it
    carries exactly that account's RBAC, and dies with the pod."""
    meta = pod.metadata
    spec = {"expirationSeconds": ttl_s,
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta.name, "uid": meta.uid}}
    if audience:
        spec["audiences"] = [audience]
    return core.create_namespaced_service_account_token(
        pod.spec.service_account_name or "default", meta.namespace, {"spec": spec}).status.token


def pod_reader(api: client.ApiClient, namespace: str, name: str = "reader") -> str:
    """A ServiceAccount that may get the namespace's pods and nothing else; returns its name."""
    rbac = client.RbacAuthorizationV1Api(api)
    client.CoreV1Api(api).create_namespaced_service_account(namespace, {"metadata": {"name": name}})
    rbac.create_namespaced_role(namespace, {"metadata": {"name": f"{name}-pods"}, "rules": [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]})
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"{name}-pods"},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
    })
    return name


def node_ready_status(node: client.V1Node) -> str | None:
    """The status ("True", "False", "Unknown") of the node's Ready condition, if any."""
    for condition in node.status.conditions or []:
        if condition.type == "Ready":
            return condition.status
    return None


def pod_scheduling_message(pod: client.V1Pod) -> str | None:
    """The scheduler's explanation for a pod it could not place."""
    for condition in pod.status.conditions or []:
        if condition.type == "PodScheduled" and condition.status == "False":
            return f"{condition.reason}: {condition.message}"
    return None


def wait_pod_phase(core: client.CoreV1Api, namespace: str, name: str, phase: str, *, timeout: float) -> client.V1Pod:
    """Wait until the pod reaches ``phase``; the timeout message carries the pod's conditions."""
    from testcluster.waits import wait_until

    def read():
        return core.read_namespaced_pod(name, namespace)

    def describe():
        pod = read()
        return f"phase={pod.status.phase} node={pod.spec.node_name} scheduling={pod_scheduling_message(pod)}"

    return wait_until(
        lambda: (pod := read()).status.phase == phase and pod,
        timeout=timeout, what=f"pod {namespace}/{name} to be {phase}", describe=describe,
    )


def wait_gone(read, *, timeout: float, what: str) -> None:
    """Wait until ``read()`` answers 404."""
    from testcluster.waits import wait_until

    def gone():
        try:
            read()
        except client.ApiException as e:
            if e.status == 404:
                return True
            raise
        return False

    wait_until(gone, timeout=timeout, what=what)
