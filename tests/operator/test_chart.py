"""The Helm chart: lint, render, drift from crds/, least-privilege RBAC, secure defaults, and
an install on the real control plane where the operator runs with only the chart's RBAC."""
import base64
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from jobkit import make_job, tool
from testcluster.kube import token_client
from testcluster.waits import wait_until

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "lazarus"
OPTIONAL_ON = ["--set", "metrics.serviceMonitor.enabled=true", "--set", "grafanaDashboard.enabled=true"]
NAMESPACED = ["--set", "operator.allNamespaces=false", "--set", "operator.namespaces={team-a,team-b}"]


def helm(*args: str, timeout: float = 120) -> str:
    binary = tool("helm")
    if binary is None:
        pytest.skip("helm is not cached; hack/build-control-plane.sh builds it")
    result = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def render(*values: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(helm("template", "lz", str(CHART), *values)) if d]


def test_chart_crd_is_the_one_in_crds():
    # The chart ships a copy (Helm installs only what is inside the chart); it must not drift.
    assert (CHART / "crds" / "lazarusjob.yaml").read_text() == (ROOT / "crds" / "lazarusjob.yaml").read_text(), \
        "helm/lazarus/crds/lazarusjob.yaml differs from crds/lazarusjob.yaml: cp crds/lazarusjob.yaml helm/lazarus/crds/"


def test_crd_schema_has_no_null_values():
    # A comma inside a YAML flow mapping silently turns words into keys with null values.
    def walk(x, path):
        if isinstance(x, dict):
            for k, v in x.items():
                assert v is not None, f"{path}.{k} is null"
                walk(v, f"{path}.{k}")
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]")
    for doc in yaml.safe_load_all((CHART / "crds" / "kopf-peering.yaml").read_text()):
        walk(doc, "kopf-peering")
    walk(yaml.safe_load((ROOT / "crds" / "lazarusjob.yaml").read_text()), "lazarusjob")


def test_helm_lint_passes_with_defaults_and_every_option():
    helm("lint", str(CHART))
    helm("lint", str(CHART), *OPTIONAL_ON)
    helm("lint", str(CHART), *OPTIONAL_ON, *NAMESPACED)


def test_every_value_is_documented():
    """Each key has a comment above it, or sits inside a documented block."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    documented_blocks: list[int] = []  # indents of documented keys that open a block
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        while documented_blocks and documented_blocks[-1] >= indent:
            documented_blocks.pop()
        commented = lines[i - 1].strip().startswith("#")
        if stripped.endswith(":"):
            if commented or documented_blocks:
                documented_blocks.append(indent)
            continue  # a parent whose children carry the comments
        assert commented or documented_blocks, f"values.yaml:{i + 1} `{stripped}` has no comment"


def test_rendered_chart_is_least_privilege_and_secure():
    docs = render(*OPTIONAL_ON)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
            "ServiceMonitor", "ConfigMap", "ClusterKopfPeering"} <= kinds
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRole"}
    assert set(roles) == {"lz-operator", "lz-operator-cluster"}  # workers need no role
    grants = {role: {(r, v) for rule in roles[role]["rules"] for r in rule["resources"]
                     for v in rule["verbs"]} for role in roles}
    for role in roles.values():
        for rule in role["rules"]:
            assert "*" not in rule["resources"] and "*" not in rule["verbs"]
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])
    # Secrets: the job's key is created, never read back.
    assert {v for r, v in grants["lz-operator"] if r == "secrets"} == {"create"}
    # The coordinator's disruption budget is created, nothing more.
    assert {v for r, v in grants["lz-operator"] if r == "poddisruptionbudgets"} == {"get", "create"}
    # What has no namespace is only read.
    assert {v for _, v in grants["lz-operator-cluster"]} <= {"get", "list", "watch", "patch"}
    assert {r for r, v in grants["lz-operator-cluster"] if v == "patch"} == {"clusterkopfpeerings"}
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    sc = pod["containers"][0]["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert "--peering=lazarus" in pod["containers"][0]["args"]
    dashboard = next(d for d in docs if d["kind"] == "ConfigMap")
    assert "lazarus_recovery_probability" in dashboard["data"]["lazarus.json"]


def test_a_namespaced_operator_is_granted_its_rights_only_in_its_namespaces():
    docs = render(*NAMESPACED)
    cluster_bindings = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    # Cluster-wide: only the read-only role (nodes, namespaces, CRDs).
    assert [b["roleRef"]["name"] for b in cluster_bindings] == ["lz-operator-cluster"]
    cluster_role = next(d for d in docs if d["metadata"]["name"] == "lz-operator-cluster")
    assert {r for rule in cluster_role["rules"] for r in rule["resources"]} == {
        "customresourcedefinitions", "namespaces", "nodes"}
    assert {v for rule in cluster_role["rules"] for v in rule["verbs"]} == {"get", "list", "watch"}
    bindings = [d for d in docs if d["kind"] == "RoleBinding"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    assert {b["roleRef"]["name"] for b in bindings} == {"lz-operator"}
    peerings = [d for d in docs if d["kind"] == "KopfPeering"]
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]


@pytest.mark.cluster
def test_chart_installs_and_the_operator_runs_with_only_its_rbac(cluster, namespace, lazarus_crds,
                                                                  operator_factory, jobs,
                                                                  scratch_nodes, tmp_path):
    release = f"lz-{uuid.uuid4().hex[:8]}"
    kubeconfig = ["--kubeconfig", str(cluster.kubeconfig)]
    helm("install", release, str(CHART), "-n", namespace, *kubeconfig,
         "--set", "operator.allNamespaces=false", "--set", f"operator.namespaces={{{namespace}}}",
         "--set", "replicaCount=1")
    try:
        token = cluster.core.create_namespaced_service_account_token(
            f"{release}-operator", namespace,
            client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
                audiences=[], expiration_seconds=3600))).status.token
        # Least privilege is real: the operator's own identity cannot read Secrets.
        as_operator = client.CoreV1Api(token_client(cluster.kubeconfig, token))
        with pytest.raises(client.ApiException) as denied:
            as_operator.list_namespaced_secret(namespace)
        assert denied.value.status == 403
        with pytest.raises(client.ApiException) as denied:
            as_operator.list_secret_for_all_namespaces()
        assert denied.value.status == 403
        # RBAC bindings reach the authorizer through an informer: wait until they apply.
        as_operator_jobs = client.CustomObjectsApi(token_client(cluster.kubeconfig, token))
        wait_until(lambda: as_operator_jobs.list_namespaced_custom_object(
            "lazarus.dev", "v1alpha1", namespace, "lazarusjobs") is not None,
            timeout=20, what="the chart's RBAC to take effect")
        # The operator process itself runs under that identity, with kopf peering on.
        op = operator_factory(kubeconfig=_token_kubeconfig(cluster.kubeconfig, token, tmp_path),
                              peering="lazarus").start()  # the chart's KopfPeering
        made = [n for names in scratch_nodes("gpu-spot", num_zones=1, nodes_per_zone=3).values()
                for n in names]
        jobs.create(make_job("chart", namespace, maxNodes=2, replicas=2))
        jobs.wait_generation("chart", 1)
        wait_until(lambda: len(jobs.workers("chart")) == 2, timeout=20, what="2 workers")
        # A whole reconfiguration under the chart's RBAC: a lost node, a new plan, a new
        # worker on the spare node, Events and status, and not one request refused.
        before = len(op.log_text())
        lost = jobs.plan_nodes("chart")[0]
        cluster.core.delete_node(lost)
        wait_until(lambda: len(jobs.plan_nodes("chart")) == 2 and lost not in jobs.plan_nodes("chart"),
                   timeout=30, what="the job to lose a node and go on with the spare one")
        assert set(jobs.plan_nodes("chart")) <= set(made)
        assert "Forbidden" not in op.log_text()[before:] and "403" not in op.log_text()[before:]
        # Everything the job needed (its key Secret, its coordinator's account and Role, its
        # NetworkPolicy) was created under the chart's RBAC, without one refusal.
        assert "Forbidden" not in op.log_text(), op.tail()
        assert jobs.status("chart")["keySecret"].startswith("chart-key-")
        # Namespaced means namespaced: nothing can be created anywhere else.
        with pytest.raises(client.ApiException) as denied:
            as_operator.create_namespaced_pod("kube-system", {
                "metadata": {"name": "lazarus-probe"},
                "spec": {"containers": [{"name": "c", "image": "busybox"}]}})
        assert denied.value.status == 403
    finally:
        for op in operator_factory.made:  # stop it before its RBAC goes away
            op.stop()
        helm("uninstall", release, "-n", namespace, *kubeconfig)


def _token_kubeconfig(admin_kubeconfig: Path, token: str, tmp_path: Path) -> Path:
    """A kubeconfig for the same server that authenticates with ``token`` only."""
    admin = yaml.safe_load(Path(admin_kubeconfig).read_text())
    cluster = dict(admin["clusters"][0]["cluster"])
    if "certificate-authority" in cluster:  # inline it: the path may be relative
        ca = Path(cluster.pop("certificate-authority"))
        if not ca.is_absolute():
            ca = Path(admin_kubeconfig).parent / ca
        cluster["certificate-authority-data"] = base64.b64encode(ca.read_bytes()).decode()
    path = tmp_path / "operator-kubeconfig.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "operator"}}],
        "current-context": "c",
    }))
    return path
