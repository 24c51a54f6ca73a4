"""The local kubelet's container mode runs a pod from its image the way a kubelet would: with
the pod's environment, securityContext, resource limits, volumes and ServiceAccount token, on
a network where Service names reach the pods they select, and with a node's loss as silent as
a reclaimed instance's."""
import json
import textwrap

import pytest

from testcluster.kube import pod_reader, wait_gone, wait_pod_phase
from testcluster.waits import wait_until

pytestmark = pytest.mark.cluster


def image_pod(name: str, node: str, image: str, script: str, **spec) -> dict:
    """A pod of ``image`` that the scheduler binds to ``node``, run by the container kubelet."""
    container = {"name": "main", "image": image, "command": ["python", "-c", textwrap.dedent(script)]}
    container |= spec.pop("container", {})
    labels = {"lazarus.dev/kubelet": "local"} | spec.pop("labels", {})
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "tolerations": [{"operator": "Exists", "effect": "NoSchedule"}],
            "restartPolicy": "Never",
            "containers": [container],
            **spec,
        },
    }


def printed(kubelet, pod: str, timeout: float = 60) -> dict:
    """The first JSON line the pod printed (a container's Python and torch take seconds)."""
    def line():
        path = kubelet.log_path(pod)
        text = path.read_text() if path.exists() else ""
        return next((l for l in text.splitlines() if l.startswith("{")), None)
    return json.loads(wait_until(line, timeout=timeout, what=f"pod {pod} to print its JSON line",
                                 describe=lambda: kubelet.log_path(pod).read_text()))


# Reads what the process really got from the kernel and the API server, not what was asked.
INSPECT = """
    import json, os, socket
    from pathlib import Path
    from kubernetes import client, config

    def status(field):
        return next(l.split()[1] for l in Path("/proc/self/status").read_text().splitlines()
                    if l.startswith(field + ":"))
    def cgroup(path):
        return int(Path("/sys/fs/cgroup", path).read_text())
    try:
        Path("/opt/written").write_text("x")
        root = "writable"
    except OSError as e:
        root = e.strerror
    Path("/scratch/written").write_text("x")  # the emptyDir is
    config.load_incluster_config()
    core, ns = client.CoreV1Api(), os.environ["POD_NAMESPACE"]
    try:
        core.list_namespaced_secret(ns)
        secrets = "listed"
    except client.ApiException as e:
        secrets = e.status
    print(json.dumps({
        "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "root": root,
        "cap_eff": status("CapEff"), "no_new_privs": status("NoNewPrivs"),
        "memory_limit": cgroup("memory/memory.limit_in_bytes"),
        "cpu_quota": cgroup("cpu/cpu.cfs_quota_us") / cgroup("cpu/cpu.cfs_period_us"),
        "cpu_shares": cgroup("cpu/cpu.shares"),
        "hostname": socket.gethostname(), "pod_ip": os.environ["POD_IP"],
        "resolved_ip": socket.gethostbyname(socket.gethostname()),
        "own_pod": core.read_namespaced_pod(os.environ["POD_NAME"], ns).metadata.name,
        "secrets": secrets,
    }))
"""


def test_a_pod_runs_from_its_image_with_its_security_context_limits_and_token(
        cluster, namespace, scratch_nodes, container_kubelet, images):
    [[node]] = scratch_nodes("gpu-spot").values()
    cluster.core.create_namespaced_pod(namespace, image_pod(
        "inspect", node, images.runtime, INSPECT, serviceAccountName=pod_reader(cluster.api, namespace),
        securityContext={"runAsNonRoot": True, "runAsUser": 10002, "runAsGroup": 10003,
                         "fsGroup": 3000},
        volumes=[{"name": "scratch", "emptyDir": {}}],
        container={
            "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
            "securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]}},
            "resources": {"requests": {"cpu": "250m"}, "limits": {"cpu": "500m", "memory": "256Mi"}},
            "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
        }))

    seen = printed(container_kubelet, "inspect")
    pod = wait_pod_phase(cluster.core, namespace, "inspect", "Succeeded", timeout=30)
    assert (seen["uid"], seen["gid"]) == (10002, 10003) and 3000 in seen["groups"]
    assert seen["root"] == "Read-only file system"
    assert seen["cap_eff"] == "0000000000000000" and seen["no_new_privs"] == "1"
    assert seen["memory_limit"] == 256 * 2**20
    assert seen["cpu_quota"] == 0.5 and seen["cpu_shares"] == 256
    # Its own address, the one the API reports and its hostname resolves to.
    assert seen["pod_ip"] == pod.status.pod_ip == seen["resolved_ip"]
    assert seen["hostname"] == "inspect"
    # The in-cluster token is bound to the pod's ServiceAccount: no more than its RBAC.
    assert seen["own_pod"] == "inspect" and seen["secrets"] == 403


SERVE = """
    import socket
    server = socket.create_server(("0.0.0.0", 7000))
    print("{}")
    while True:
        conn, _ = server.accept()
        conn.sendall(socket.gethostname().encode())
        conn.close()
"""

ASK = """
    import json, socket, time
    def ask(host):
        for _ in range(100):  # the server may still be starting
            try:
                with socket.create_connection((host, 7000), timeout=2) as s:
                    return s.recv(100).decode()
            except OSError as e:
                error = repr(e)
                time.sleep(0.2)
        return error
    def resolve(name):
        try:
            return socket.gethostbyname(name)
        except OSError:
            return None
    print(json.dumps({name: ask(name) for name in NAMES} | {
        "self": resolve(socket.gethostname()), "peer": resolve(PEER), "nobody": resolve(NOBODY)}))
"""


def test_service_names_resolve_to_the_pods_they_select(cluster, namespace, scratch_nodes,
                                                        container_kubelet, images):
    [[node_a, node_b]] = scratch_nodes("gpu-spot", nodes_per_zone=2).values()
    core = cluster.core
    core.create_namespaced_service(namespace, {
        "metadata": {"name": "store"},
        "spec": {"selector": {"app": "store"}, "ports": [{"port": 7000, "targetPort": 7000}]}})
    core.create_namespaced_service(namespace, {
        "metadata": {"name": "peers"},
        "spec": {"clusterIP": "None", "selector": {"app": "peer"}, "ports": [{"port": 7000}]}})
    core.create_namespaced_pod(namespace, image_pod("server", node_a, images.runtime, SERVE,
                                                    labels={"app": "store"}))
    core.create_namespaced_pod(namespace, image_pod("bystander", node_a, images.runtime, SERVE,
                                                    labels={"app": "other"}))
    names = ["store", f"store.{namespace}", f"store.{namespace}.svc",
             f"store.{namespace}.svc.cluster.local"]
    script = (f"NAMES = {names!r}\nPEER = 'client.peers.{namespace}.svc'\n"
              f"NOBODY = 'bystander.peers.{namespace}.svc'\n" + textwrap.dedent(ASK))
    core.create_namespaced_pod(namespace, image_pod("client", node_b, images.runtime, script,
                                                    labels={"app": "peer"}, hostname="client",
                                                    subdomain="peers"))

    seen = printed(container_kubelet, "client", timeout=90)
    assert {name: seen[name] for name in names} == {name: "server" for name in names}
    client_ip = wait_pod_phase(core, namespace, "client", "Succeeded", timeout=30).status.pod_ip
    assert seen["self"] == seen["peer"] == client_ip
    assert seen["nobody"] is None, "a pod outside the headless Service got its name"


def test_runasnonroot_refuses_a_root_user_and_the_pod_says_why(cluster, namespace, scratch_nodes,
                                                              container_kubelet, images):
    [[node]] = scratch_nodes("gpu-spot").values()
    cluster.core.create_namespaced_pod(namespace, image_pod(
        "root", node, images.runtime, "print('ran')",
        securityContext={"runAsNonRoot": True, "runAsUser": 0}))

    def waiting():
        statuses = cluster.core.read_namespaced_pod("root", namespace).status.container_statuses
        return statuses and statuses[0].state.waiting
    state = wait_until(waiting, timeout=30, what="the pod to report why it cannot start")
    assert state.reason == "CreateContainerError" and "runAsNonRoot" in state.message
    assert not container_kubelet.log_path("root").exists() or "ran" not in container_kubelet.log_path("root").read_text()


HOLD = """
    import json, socket, time
    for _ in range(100):
        try:
            conn = socket.create_connection(("store", 7000), timeout=2)
            break
        except OSError:
            time.sleep(0.2)
    conn.settimeout(None)
    print("{}")
    conn.settimeout(8)
    try:
        heard = "data" if conn.recv(1) else "closed"
    except socket.timeout:
        heard = "nothing"
    except OSError as e:
        heard = repr(e)
    print(json.dumps({"heard": heard}))
"""

SILENT_SERVER = """
    import signal, socket, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # so only a SIGKILL ends it
    server = socket.create_server(("0.0.0.0", 7000))
    print("{}")
    conns = []
    while True:
        conn, _ = server.accept()
        conns.append(conn)  # never answers, never closes
"""


@pytest.mark.parametrize("fault", ["node deleted", "pod deleted"])
def test_a_lost_node_is_silent_to_peers_and_a_deleted_pod_is_not(
        cluster, namespace, scratch_nodes, container_kubelet, images, fault):
    [[doomed, spared]] = scratch_nodes("gpu-spot", nodes_per_zone=2).values()
    core = cluster.core
    core.create_namespaced_service(namespace, {
        "metadata": {"name": "store"},
        "spec": {"selector": {"app": "store"}, "ports": [{"port": 7000, "targetPort": 7000}]}})
    core.create_namespaced_pod(namespace, image_pod("server", doomed, images.runtime, SILENT_SERVER,
                                                    labels={"app": "store"},
                                                    terminationGracePeriodSeconds=1))
    core.create_namespaced_pod(namespace, image_pod("peer", spared, images.runtime, HOLD))
    printed(container_kubelet, "server")
    wait_until(lambda: "{}" in container_kubelet.log_path("peer").read_text(), timeout=60,
               what="the peer to connect to the server")
    server = container_kubelet.process("server")

    if fault == "node deleted":
        core.delete_node(doomed)
    else:
        core.delete_namespaced_pod("server", namespace)
        wait_gone(lambda: core.read_namespaced_pod("server", namespace), timeout=30,
                  what="the pod's deletion after its grace period")

    wait_until(lambda: server.poll() is not None, timeout=10, what="the server's container to die")
    assert server.returncode == 137  # SIGKILLed: it ignores SIGTERM
    heard = wait_until(lambda: next((json.loads(line)["heard"] for line in
                                     container_kubelet.log_path("peer").read_text().splitlines()
                                     if line.startswith('{"heard"')), None),
                       timeout=30, what="the peer to report what it heard")
    # A reclaimed node closes nothing: its peers find out from the controller, not TCP.
    assert heard == ("nothing" if fault == "node deleted" else "closed"), heard
