"""The local kubelet runs labelled pods as real processes, with a pod's environment, identity
and lifecycle: the real scheduler picks the node, pod and node deletion stop the process the
way a kubelet or a reclaimed spot node would, and the process gets its ServiceAccount's RBAC."""
import json
import sys
import textwrap

import pytest

from testcluster.kube import pod_reader, wait_gone, wait_pod_phase
from testcluster.kubelet import REPORTED_IP
from testcluster.waits import wait_until

pytestmark = pytest.mark.cluster


def kubelet_pod(name: str, node: str, script: str, *, env: list | None = None, **spec) -> dict:
    """A pod the scheduler binds to ``node`` (whatever the pool's taints), run by the local kubelet."""
    return {
        "metadata": {"name": name, "labels": {"lazarus.dev/kubelet": "local"}},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "tolerations": [{"operator": "Exists", "effect": "NoSchedule"}],
            "restartPolicy": "Never",
            "containers": [{"name": "worker", "image": "lazarus-runtime:dev",
                            "command": ["python", "-c", textwrap.dedent(script)], "env": env or []}],
            **spec,
        },
    }


def field(name: str, path: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def printed_json(local_kubelet, pod: str) -> dict:
    """The first line the pod's process printed, as JSON, once it has printed one."""
    line = wait_until(lambda: local_kubelet.log_path(pod).read_text().partition("\n")[0],
                      timeout=15, what=f"pod {pod} to print its line")
    return json.loads(line)


def test_pod_runs_with_its_downward_api_env_and_service_addresses(cluster, namespace, scratch_nodes, local_kubelet):
    [[node]] = scratch_nodes("gpu-spot").values()
    names = ["POD_NAME", "POD_NAMESPACE", "NODE_NAME", "POD_IP", "RANK", "GREETING", "ESCAPED", "COORDINATOR",
             "STORE", "KUBECONFIG", "PYTEST_CURRENT_TEST"]
    cluster.core.create_namespaced_pod(namespace, kubelet_pod("worker", node, f"""
        import json, os, sys, time
        print(json.dumps({{k: os.environ.get(k) for k in {names!r}}} | {{"python": sys.executable}}))
        time.sleep(60)
    """, env=[
        field("POD_NAME", "metadata.name"), field("POD_NAMESPACE", "metadata.namespace"),
        field("NODE_NAME", "spec.nodeName"), field("POD_IP", "status.podIP"),
        field("RANK", "metadata.labels['lazarus.dev/kubelet']"),
        {"name": "GREETING", "value": "hello $(POD_NAME) on $(NODE_NAME)"},
        {"name": "ESCAPED", "value": "$$(POD_NAME) $(UNDEFINED)"},
        {"name": "COORDINATOR", "value": f"coordinator.{namespace}.svc:1234"},
        {"name": "STORE", "value": f"http://store.{namespace}.svc.cluster.local:80/x"},
    ]))

    pod = wait_pod_phase(cluster.core, namespace, "worker", "Running", timeout=30)
    # The API holds a routable-looking address (it refuses loopback ones in Endpoints); the
    # process is told the one it can use.
    assert pod.status.pod_ip == pod.status.host_ip == REPORTED_IP
    assert {c.type: c.status for c in pod.status.conditions}["Ready"] == "True"
    assert pod.status.container_statuses[0].state.running is not None
    env = printed_json(local_kubelet, "worker")
    assert env["POD_NAME"] == "worker" and env["POD_NAMESPACE"] == namespace
    assert env["NODE_NAME"] == node == pod.spec.node_name
    assert env["POD_IP"] == "127.0.0.1" and env["RANK"] == "local"
    assert env["GREETING"] == f"hello worker on {node}"
    assert env["ESCAPED"] == "$(POD_NAME) $(UNDEFINED)"
    assert env["COORDINATOR"] == "127.0.0.1:1234"
    assert env["STORE"] == "http://127.0.0.1:80/x"
    assert env["PYTEST_CURRENT_TEST"] is None, "the test's whole environment leaked into the pod"
    assert env["KUBECONFIG"] != str(cluster.kubeconfig), "the pod must not get the admin's kubeconfig"
    assert env["python"] == sys.executable


def test_exit_code_decides_the_pod_phase(cluster, namespace, scratch_nodes, local_kubelet):
    [[node]] = scratch_nodes("gpu-spot").values()
    for name, code in (("fails", 3), ("succeeds", 0)):
        # It runs long enough to be reported Running first, which the exit's status replaces.
        cluster.core.create_namespaced_pod(namespace, kubelet_pod(name, node, f"""
            import time
            time.sleep(0.5)
            raise SystemExit({code})
        """))

    for name, code, phase, reason in (("fails", 3, "Failed", "Error"), ("succeeds", 0, "Succeeded", "Completed")):
        pod = wait_pod_phase(cluster.core, namespace, name, phase, timeout=30)
        terminated = pod.status.container_statuses[0].state.terminated
        assert (terminated.exit_code, terminated.reason) == (code, reason)
        assert pod.status.container_statuses[0].state.running is None
        assert {c.type: c.status for c in pod.status.conditions}["Ready"] == "False"
        assert local_kubelet.process(name).returncode == code


def test_deleting_the_pod_sigterms_its_process_and_finishes_the_deletion(
        cluster, namespace, scratch_nodes, local_kubelet, tmp_path):
    [[node]] = scratch_nodes("gpu-spot").values()
    marker = tmp_path / "sigterm"
    cluster.core.create_namespaced_pod(namespace, kubelet_pod("worker", node, f"""
        import pathlib, signal, sys, time
        def stop(*_):
            pathlib.Path({str(marker)!r}).write_text("SIGTERM")
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        print("{{}}")
        time.sleep(60)
    """))
    printed_json(local_kubelet, "worker")  # its handler is installed

    cluster.core.delete_namespaced_pod("worker", namespace)

    wait_gone(lambda: cluster.core.read_namespaced_pod("worker", namespace), timeout=15,
              what="the local kubelet to finish the pod's deletion")
    assert marker.read_text() == "SIGTERM"
    assert local_kubelet.process("worker").returncode == 0


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace_period(
        cluster, namespace, scratch_nodes, local_kubelet):
    [[node]] = scratch_nodes("gpu-spot").values()
    cluster.core.create_namespaced_pod(namespace, kubelet_pod("worker", node, """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("{}")
        time.sleep(60)
    """))
    printed_json(local_kubelet, "worker")

    cluster.core.delete_namespaced_pod("worker", namespace, grace_period_seconds=1)

    wait_gone(lambda: cluster.core.read_namespaced_pod("worker", namespace), timeout=10,
              what="the pod to go once its grace period is over")
    assert local_kubelet.process("worker").returncode == -9


def test_deleting_the_node_sigkills_its_processes_and_only_those(cluster, namespace, scratch_nodes, local_kubelet):
    [[doomed, spared]] = scratch_nodes("gpu-spot", nodes_per_zone=2).values()
    script = """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # so only a SIGKILL ends it
        time.sleep(60)
    """
    for node in (doomed, spared):
        cluster.core.create_namespaced_pod(namespace, kubelet_pod(f"on-{node}", node, script))
    for node in (doomed, spared):
        wait_pod_phase(cluster.core, namespace, f"on-{node}", "Running", timeout=30)

    cluster.core.delete_node(doomed)

    killed = local_kubelet.process(f"on-{doomed}")
    wait_until(lambda: killed.poll() is not None, timeout=5, what="the process on the deleted node to die")
    assert killed.returncode == -9
    assert local_kubelet.process(f"on-{spared}").poll() is None
    # Nobody is left to report on the vanished node's pod.
    assert cluster.core.read_namespaced_pod(f"on-{doomed}", namespace).status.phase == "Running"


def test_the_process_has_exactly_its_service_accounts_rbac(cluster, namespace, scratch_nodes, local_kubelet):
    [[node]] = scratch_nodes("gpu-spot").values()
    core = cluster.core
    account = pod_reader(cluster.api, namespace)
    core.create_namespaced_pod(namespace, kubelet_pod("worker", node, """
        import json, os
        from kubernetes import client, config
        config.load_kube_config()
        core, namespace = client.CoreV1Api(), os.environ["POD_NAMESPACE"]
        result = {"own_pod": core.read_namespaced_pod(os.environ["POD_NAME"], namespace).metadata.name}
        try:
            core.list_namespaced_secret(namespace)
            result["secrets"] = "listed"
        except client.ApiException as e:
            result["secrets"] = e.status
        print(json.dumps(result))
    """, env=[field("POD_NAME", "metadata.name"), field("POD_NAMESPACE", "metadata.namespace")],
        serviceAccountName=account))

    wait_pod_phase(core, namespace, "worker", "Succeeded", timeout=30)
    assert printed_json(local_kubelet, "worker") == {"own_pod": "worker", "secrets": 403}


def test_secrets_reach_the_environment_and_each_pod_has_its_own_home(
        cluster, namespace, scratch_nodes, local_kubelet):
    [[node]] = scratch_nodes("gpu-spot").values()
    core = cluster.core
    core.create_namespaced_secret(namespace, {"metadata": {"name": "creds"},
                                              "stringData": {"KEY_ID": "id-1", "SECRET": "s3cr3t"}})
    script = """
        import json, os, pathlib
        pathlib.Path("mine.txt").write_text(os.environ["POD_NAME"])  # a relative path
        print(json.dumps({k: os.environ.get(k) for k in ("KEY_ID", "SECRET", "ONE", "HOME")}
                         | {"cwd": os.getcwd()}))
    """
    env = [field("POD_NAME", "metadata.name"),
           {"name": "ONE", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "KEY_ID"}}}]
    for name in ("a", "b"):
        pod = kubelet_pod(name, node, script, env=env)
        pod["spec"]["containers"][0]["envFrom"] = [{"secretRef": {"name": "creds"}}]
        core.create_namespaced_pod(namespace, pod)
    seen = {}
    for name in ("a", "b"):
        wait_pod_phase(core, namespace, name, "Succeeded", timeout=30)
        seen[name] = printed_json(local_kubelet, name)
        assert (seen[name]["KEY_ID"], seen[name]["SECRET"], seen[name]["ONE"]) == (
            "id-1", "s3cr3t", "id-1")
        assert seen[name]["cwd"] == seen[name]["HOME"] == str(local_kubelet.home(name))
        assert (local_kubelet.home(name) / "mine.txt").read_text() == name
    assert seen["a"]["cwd"] != seen["b"]["cwd"]


def test_a_pod_whose_secret_is_missing_waits_and_says_why(cluster, namespace, scratch_nodes,
                                                         local_kubelet):
    [[node]] = scratch_nodes("gpu-spot").values()
    pod = kubelet_pod("worker", node, "print('never')")
    pod["spec"]["containers"][0]["envFrom"] = [{"secretRef": {"name": "absent"}}]
    cluster.core.create_namespaced_pod(namespace, pod)
    waiting = wait_until(
        lambda: (s := cluster.core.read_namespaced_pod("worker", namespace).status.container_statuses)
        and s[0].state.waiting, timeout=30, what="the pod to report why it waits")
    assert waiting.reason == "CreateContainerConfigError" and "absent" in waiting.message
    assert local_kubelet.process("worker") is None


def test_a_failed_process_leaves_its_last_log_lines_as_the_termination_message(
        cluster, namespace, scratch_nodes, local_kubelet):
    [[node]] = scratch_nodes("gpu-spot").values()
    for name, policy in (("fallback", "FallbackToLogsOnError"), ("file", "File")):
        pod = kubelet_pod(name, node, """
            import sys
            print("\\n".join(f"line {i}" for i in range(200)))
            sys.exit("error: spec.runtime.model: unknown model 'gpt-xxl'")
        """)
        pod["spec"]["containers"][0]["terminationMessagePolicy"] = policy
        cluster.core.create_namespaced_pod(namespace, pod)
    fallback = wait_pod_phase(cluster.core, namespace, "fallback", "Failed", timeout=30)
    message = fallback.status.container_statuses[0].state.terminated.message
    assert message.endswith("error: spec.runtime.model: unknown model 'gpt-xxl'")
    assert len(message.splitlines()) == 80 and len(message) <= 2048
    file = wait_pod_phase(cluster.core, namespace, "file", "Failed", timeout=30)
    assert file.status.container_statuses[0].state.terminated.message is None
