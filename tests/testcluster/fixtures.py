"""pytest fixtures for tests against a real Kubernetes API server.

- ``cluster`` (session): the local kwok cluster of hack/cluster.sh, started if missing and
  reused if running; or, when LAZARUS_TEST_KUBECONFIG is set, that cluster (kind, a real one).
  The local cluster keeps running afterwards, for the next session (and any other session
  running now) to reuse; ``hack/cluster.sh down`` stops it. LAZARUS_CLUSTER_TEARDOWN=1 deletes
  it at the end of a session that started it.
- ``namespace`` (function): a fresh namespace, deleted afterwards.
- ``scratch_nodes`` (function, local cluster only): makes simulated nodes of a pool in zones
  of the test's own, deleted afterwards, so faults injected into them touch no other test.

When a test that uses ``cluster`` fails, its report gets the namespace's events and pods, the
logs of pods in ``cluster.diagnostic_namespaces`` and of the files in ``cluster.log_files``
(the operator's), and the tail of each control-plane component's log.

Kubernetes is imported lazily, so loading these fixtures costs unit tests nothing.
"""
from __future__ import annotations

import os
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

LOG_TAIL_LINES = 40
NAMESPACE_READY_TIMEOUT_S = 30


@dataclass
class Cluster:
    """A cluster the tests talk to, and what to show when a test on it fails."""

    kubeconfig: Path
    # The kwok cluster of hack/cluster.sh: nodes and pod status are simulated, faults are
    # injected through kwok, and the components' logs are files in logs_dir.
    local: bool
    logs_dir: Path | None = None
    # Registered by other fixtures, for example the operator's log file and namespace.
    log_files: dict[str, Path] = field(default_factory=dict)
    diagnostic_namespaces: list[str] = field(default_factory=list)

    def __post_init__(self):
        from testcluster.kube import api_client

        self.api = api_client(self.kubeconfig)

    @property
    def core(self):
        from kubernetes import client

        return client.CoreV1Api(self.api)

    def env(self) -> dict[str, str]:
        """The environment for a subprocess (kubectl, helm, the operator) that should talk to
        this cluster: its KUBECONFIG, and the cached kubectl and helm first on PATH."""
        from testcluster.local import tools_path

        return os.environ | {
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": f"{tools_path()}:{os.environ.get('PATH', '')}",
        }

    def api_as(self, user: str):
        """An API client that impersonates ``user`` (RBAC applies to it, not to the admin)."""
        from testcluster.kube import api_client

        return api_client(self.kubeconfig, impersonate=user)


@pytest.fixture(scope="session")
def cluster():
    from testcluster import local

    external = os.environ.get("LAZARUS_TEST_KUBECONFIG")
    if external:
        yield Cluster(kubeconfig=Path(external), local=False, diagnostic_namespaces=["kube-system"])
        return
    was_running = local.is_running()
    kubeconfig, _ = local.up()
    yield Cluster(kubeconfig=kubeconfig, local=True, logs_dir=local.logs_dir())
    if not was_running and os.environ.get("LAZARUS_CLUSTER_TEARDOWN") == "1":
        local.down()


@pytest.fixture
def namespace(cluster, request):
    """A fresh namespace named after the test, ready for pods (its default ServiceAccount
    exists), and deleted after the test without waiting."""
    from kubernetes import client

    from testcluster.waits import wait_until

    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{slug}-{uuid.uuid4().hex[:6]}"
    core = cluster.core
    core.create_namespace(client.V1Namespace(
        metadata=client.V1ObjectMeta(name=name, labels={"lazarus.dev/test": "true"})
    ))
    wait_until(
        lambda: core.list_namespaced_service_account(name, field_selector="metadata.name=default").items,
        timeout=NAMESPACE_READY_TIMEOUT_S,
        what=f"the default ServiceAccount of namespace {name} (kube-controller-manager creates it)",
    )
    yield name
    core.delete_namespace(name)


@pytest.fixture
def scratch_nodes(cluster, namespace):
    """``make(pool, num_zones=1, nodes_per_zone=1) -> {zone: [node names]}``: new kwok nodes
    built from a pool of hack/nodepools.yaml, in zones named after the test's namespace."""
    from testcluster.nodepools import apply_nodes, build_node, load_pools
    from testcluster.waits import wait_until
    from testcluster.kube import node_ready_status

    if not cluster.local:
        pytest.skip("scratch nodes are simulated by kwok, which only the local cluster runs")
    node_pools = load_pools()
    core = cluster.core
    made: list[str] = []

    def make(pool_name: str, num_zones: int = 1, nodes_per_zone: int = 1) -> dict[str, list[str]]:
        pool = node_pools.pool(pool_name)
        zones = {}
        for z in range(num_zones):
            zone = f"{namespace}-z{len(made)}-{z}"
            names = [f"{zone}-{i}" for i in range(nodes_per_zone)]
            nodes = [build_node(pool, node_pools.region, zone, name) for name in names]
            for node in nodes:
                node["metadata"]["labels"]["lazarus.dev/scratch"] = namespace
            apply_nodes(core, nodes)
            made.extend(names)
            zones[zone] = names
        for name in (n for names in zones.values() for n in names):
            wait_until(lambda name=name: node_ready_status(core.read_node(name)) == "True",
                       timeout=30, what=f"kwok to make node {name} Ready")
        return zones

    yield make
    for name in made:
        try:
            core.delete_node(name)
        except Exception as e:  # noqa: BLE001 - a test may have deleted it already
            if getattr(e, "status", None) != 404:
                raise


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    cluster = item.funcargs.get("cluster") if hasattr(item, "funcargs") else None
    if report.when == "call" and report.failed and isinstance(cluster, Cluster):
        report.sections.append(("cluster diagnostics", _diagnostics(cluster, item.funcargs.get("namespace"))))


def _diagnostics(cluster: Cluster, namespace: str | None) -> str:
    """Everything that helps explain a failure, each part best effort."""
    parts = []

    def section(title, produce):
        try:
            parts.append(f"===== {title}\n{produce()}")
        except Exception as e:  # noqa: BLE001 - a broken cluster must not hide the test's failure
            parts.append(f"===== {title}\n(unavailable: {e!r})")

    core = cluster.core
    if namespace:
        section(f"events in {namespace}", lambda: _events(core, namespace))
        section(f"pods in {namespace}", lambda: _pods(core, namespace))
    for ns in cluster.diagnostic_namespaces:
        section(f"pod logs in {ns}", lambda ns=ns: _pod_logs(core, ns))
    section("nodes", lambda: _nodes(core))
    for title, path in cluster.log_files.items():
        section(f"{title} ({path})", lambda path=path: _tail(path))
    if cluster.logs_dir and cluster.logs_dir.is_dir():
        for path in sorted(cluster.logs_dir.glob("*.log")):
            section(f"{path.stem} (last {LOG_TAIL_LINES} lines of {path})", lambda path=path: _tail(path))
    return "\n".join(parts)


def _tail(path: Path) -> str:
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])


def _events(core, namespace: str) -> str:
    events = core.list_namespaced_event(namespace).items
    events.sort(key=lambda e: str(e.last_timestamp or e.event_time or ""))
    return "\n".join(
        f"{e.type} {e.reason} {e.involved_object.kind}/{e.involved_object.name}: {e.message}" for e in events
    ) or "(none)"


def _pods(core, namespace: str) -> str:
    lines = []
    for pod in core.list_namespaced_pod(namespace).items:
        conditions = ", ".join(f"{c.type}={c.status}({c.reason or ''})" for c in pod.status.conditions or [])
        lines.append(f"{pod.metadata.name}: phase={pod.status.phase} node={pod.spec.node_name} {conditions}")
    return "\n".join(lines) or "(none)"


def _pod_logs(core, namespace: str) -> str:
    lines = []
    for pod in core.list_namespaced_pod(namespace).items:
        log = core.read_namespaced_pod_log(pod.metadata.name, namespace, tail_lines=LOG_TAIL_LINES)
        lines.append(f"--- {pod.metadata.name}\n{log}")
    return "\n".join(lines) or "(no pods)"


def _nodes(core) -> str:
    from testcluster.kube import node_ready_status

    return "\n".join(
        f"{n.metadata.name}: Ready={node_ready_status(n)} unschedulable={bool(n.spec.unschedulable)} "
        f"taints={[f'{t.key}:{t.effect}' for t in n.spec.taints or []]}"
        for n in core.list_node().items
    )
