"""RBAC is enforced: a ServiceAccount may do only what a binding grants it."""
import pytest
from kubernetes import client

from testcluster.kube import status_of, token_client
from testcluster.waits import wait_until

pytestmark = pytest.mark.cluster


def test_service_account_is_denied_until_a_role_binding_allows_it(cluster, namespace):
    core = cluster.core
    rbac = client.RbacAuthorizationV1Api(cluster.api)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "worker"}})
    token = core.create_namespaced_service_account_token(
        "worker", namespace,
        client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=600)),
    ).status.token
    as_worker = client.CoreV1Api(token_client(cluster.kubeconfig, token))

    assert status_of(lambda: as_worker.list_namespaced_pod(namespace)) == 403

    rbac.create_namespaced_role(namespace, {
        "metadata": {"name": "pod-reader"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}],
    })
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": "worker-reads-pods"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "worker", "namespace": namespace}],
    })

    # The authorizer sees new bindings through a watch, a moment later.
    wait_until(lambda: status_of(lambda: as_worker.list_namespaced_pod(namespace)) == 200,
               timeout=15, what="the RoleBinding to allow listing pods")
    # Only the granted verbs, only in the bound namespace.
    assert status_of(lambda: as_worker.delete_collection_namespaced_pod(namespace)) == 403
    assert status_of(lambda: as_worker.list_namespaced_pod("kube-system")) == 403


def test_impersonated_service_account_gets_the_same_answer(cluster, namespace):
    core = cluster.core
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "nobody"}})
    as_nobody = client.CoreV1Api(cluster.api_as(f"system:serviceaccount:{namespace}:nobody"))

    assert status_of(lambda: as_nobody.list_namespaced_pod(namespace)) == 403
    assert status_of(lambda: core.list_namespaced_pod(namespace)) == 200
