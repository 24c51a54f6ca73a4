"""A local stand-in for the kubelet: each pod labelled ``lazarus.dev/kubelet`` (kwok leaves those
alone, see hack/kwok-stages.yaml) runs its first container on this machine, and its status is
reported through the API, so full-stack e2e tests run real workers on the real scheduler's
choice of kwok node. Two runtimes:

- processes (``local_kubelet``): the container's command as a local process, with this test's
  Python for ``python``, on this host's network (Service names are rewritten to 127.0.0.1),
  and no image, volumes or securityContext. Each process gets a working directory and HOME of
  its own (its pod's folder), as each container has its own filesystem: two pods share files
  only through an absolute path both name, the stand-in for a shared volume;
- containers (``container_kubelet``, testcluster.containers): the pod from its image in the
  local Docker engine, with its securityContext, resources, volumes and ServiceAccount token,
  on a network of its own where Service names resolve to the right containers.

In both, Secrets reach the environment as the kubelet passes them (``envFrom`` and
``valueFrom.secretKeyRef``); a missing one leaves the pod waiting, as on a real node. A failed
container under FallbackToLogsOnError reports its log's tail as its termination message.

A pod is never restarted, whatever its restartPolicy, and has no probes. Pod deletion stops
it (SIGTERM, then SIGKILL after the grace period); node deletion SIGKILLs everything on that
node, as a reclaimed spot instance would (a container first loses its network, so its peers
hear nothing).

Kubernetes is imported lazily, so loading this fixture costs unit tests nothing.
"""
from __future__ import annotations

import base64
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import pytest


log = logging.getLogger(__name__)

LABEL = "lazarus.dev/kubelet"
LOCAL_IP = "127.0.0.1"  # every pod shares this host's network
# What the API is told instead: Endpoints and EndpointSlices refuse loopback addresses, and
# the endpoint controllers would retry them forever. Nothing routes it; processes use LOCAL_IP.
REPORTED_IP = "10.255.255.1"
BASE_ENV = ("PATH", "HOME", "PYTHONPATH", "LANG")
POLL_S = 0.05
WATCH_TIMEOUT_S = 10  # also how long a stopped kubelet's watch threads may linger
RETRY_S = 1.0
MAX_GRACE_S = 10
# A failed container's log tail, as the kubelet's FallbackToLogsOnError takes it.
TERMINATION_MESSAGE_BYTES = 2048
TERMINATION_MESSAGE_LINES = 80
# No cluster DNS or kube-proxy runs here, and every process listens on this host: a Service
# address NAME.NAMESPACE.svc[.cluster.local] must reach 127.0.0.1 (the port is kept).
SERVICE_HOST = re.compile(r"(?<![\w.-])[a-z0-9-]+\.[a-z0-9-]+\.svc(?:\.cluster\.local)?(?![\w.-])")
VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
LABEL_REF = re.compile(r"metadata\.(labels|annotations)\['(.+)'\]")


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: $$ escapes a $, and an unknown name stays as written."""
    return VAR_REF.sub(lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), value)


@dataclass(frozen=True)
class Addresses:
    """Where a pod is: what its process is told (downward API) and what the API is told."""
    pod: str
    host: str
    reported_pod: str
    reported_host: str


def field_ref(pod, path: str, addresses: Addresses) -> str:
    """The value of a downward-API fieldRef (env, and projected volumes in container mode)."""
    if m := LABEL_REF.fullmatch(path):
        return (getattr(pod.metadata, m[1]) or {}).get(m[2], "")
    fields = {
        "metadata.name": pod.metadata.name, "metadata.namespace": pod.metadata.namespace,
        "metadata.uid": pod.metadata.uid, "spec.nodeName": pod.spec.node_name,
        "spec.serviceAccountName": pod.spec.service_account_name or "default",
        "status.podIP": addresses.pod, "status.hostIP": addresses.host,
    }
    if path not in fields:
        raise ValueError(f"env fieldRef {path!r} is not supported by the local kubelet")
    return fields[path]


class _ConfigError(ValueError):
    """The container's configuration cannot be resolved (a missing Secret or key)."""


def _container_env(pod, container, runtime, addresses: Addresses, secret) -> dict[str, str]:
    """The runtime's basics (never the test's whole environment: no admin KUBECONFIG), then
    the container's, with addresses as the runtime reaches them. ``secret(name)`` reads a
    Secret's data, or None when it does not exist."""
    env = runtime.base_env()
    for source in container.env_from or []:
        if source.secret_ref is None:
            raise ValueError("envFrom: only secretRef is supported by the local kubelet")
        data = secret(source.secret_ref.name)
        if data is None:
            if source.secret_ref.optional:
                continue
            raise _ConfigError(f'secret "{source.secret_ref.name}" not found')
        env |= {(source.prefix or "") + k: v for k, v in data.items()}
    for var in container.env or []:
        if var.value_from is None:
            value = _expand(var.value or "", env)
        elif var.value_from.field_ref is not None:
            value = field_ref(pod, var.value_from.field_ref.field_path, addresses)
        elif var.value_from.secret_key_ref is not None:
            ref = var.value_from.secret_key_ref
            value = (secret(ref.name) or {}).get(ref.key)
            if value is None:
                if ref.optional:
                    continue
                raise _ConfigError(f"couldn't find key {ref.key} in Secret {ref.name}")
        else:
            raise ValueError(f"env {var.name}: only value and valueFrom.fieldRef or "
                             f"secretKeyRef are supported by the local kubelet")
        env[var.name] = runtime.address(value)
    return env


class ProcessRuntime:
    """Pods as local processes on this host's network (see the module docstring)."""

    ADDRESSES = Addresses(LOCAL_IP, LOCAL_IP, REPORTED_IP, REPORTED_IP)

    def __init__(self, api, namespace: str):
        from kubernetes import client

        self._api, self._core, self._namespace = api, client.CoreV1Api(api), namespace

    def addresses(self) -> Addresses:
        return self.ADDRESSES

    @staticmethod
    def base_env() -> dict[str, str]:
        # Unbuffered, so a SIGKILLed process's log still holds everything it printed.
        return {k: os.environ[k] for k in BASE_ENV if k in os.environ} | {"PYTHONUNBUFFERED": "1"}

    @staticmethod
    def address(value: str) -> str:
        return SERVICE_HOST.sub(LOCAL_IP, value)

    def prepare(self, pod, container, env: dict[str, str], command: list[str], args: list[str],
                pod_dir: Path, addresses: Addresses):
        """Everything but the start (API calls, files); returns the start, which the kubelet
        calls under its lock."""
        argv = command + args
        if not argv:
            raise ValueError("the container has no command; the local kubelet cannot run an image's entrypoint")
        if argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        home = pod_dir / "home"
        home.mkdir(parents=True, exist_ok=True)
        env = dict(env) | {"HOME": str(home)}
        if pod.spec.automount_service_account_token is not False:
            env["KUBECONFIG"] = str(self._write_kubeconfig(pod, pod_dir))

        def start(log_path: Path) -> subprocess.Popen:
            with open(log_path, "ab") as out:
                return subprocess.Popen(argv, cwd=home, env=env, stdin=subprocess.DEVNULL,
                                        stdout=out, stderr=subprocess.STDOUT)
        return start

    def _write_kubeconfig(self, pod, pod_dir: Path) -> Path:
        """A kubeconfig with a token bound to the pod, so the process has exactly its
        ServiceAccount's RBAC (the project's processes fall back from in-cluster config to it)."""
        from testcluster.kube import pod_token

        conf = self._api.configuration
        account = pod.spec.service_account_name or "default"
        cluster = {"server": conf.host}
        if conf.ssl_ca_cert:
            cluster["certificate-authority-data"] = base64.b64encode(Path(conf.ssl_ca_cert).read_bytes()).decode()
        path = pod_dir / "kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "pod",
            "clusters": [{"name": "cluster", "cluster": cluster}],
            "users": [{"name": account, "user": {"token": pod_token(self._core, pod)}}],
            "contexts": [{"name": "pod", "context": {
                "cluster": "cluster", "user": account, "namespace": self._namespace}}],
        }))
        path.chmod(0o600)
        return path

    @staticmethod
    def lose(handle: subprocess.Popen) -> None:
        handle.kill()

    def close(self) -> None:
        pass


@dataclass
class _Process:
    popen: subprocess.Popen  # or a testcluster.containers.Container, which acts like one
    uid: str
    node: str
    container: object  # its V1Container
    started_at: str
    addresses: Addresses
    reported: str | None = None  # the phase last written to the pod's status
    kill_at: float | None = None  # SIGKILL deadline of a SIGTERMed process
    deleting: bool = False  # finish the pod's deletion once the process has exited
    gone: bool = False  # the pod or its node is gone: nothing left to report


class LocalKubelet:
    """Runs the labelled pods of one namespace with ``runtime`` (ProcessRuntime or
    testcluster.containers.ContainerRuntime), until ``stop()``."""

    def __init__(self, api, namespace: str, log_dir: Path, runtime=None):
        from kubernetes import client

        self._api, self._namespace, self._log_dir = api, namespace, Path(log_dir)
        self._core = client.CoreV1Api(api)
        self._runtime = runtime or ProcessRuntime(api, namespace)
        self._lock = threading.Lock()  # guards _procs and _dead_nodes
        self._procs: dict[str, _Process] = {}
        self._dead_nodes: set[str] = set()
        self._stopped = threading.Event()
        self._monitor_thread = threading.Thread(target=self._monitor, name="kubelet-monitor", daemon=True)

    def start(self) -> LocalKubelet:
        pods = dict(namespace=self._namespace, label_selector=LABEL)
        for name, args in (("kubelet-pods", (self._core.list_namespaced_pod, pods, self._on_pods, self._on_pod)),
                           ("kubelet-nodes", (self._core.list_node, {}, self._on_nodes, self._on_node))):
            threading.Thread(target=self._watch, args=args, name=name, daemon=True).start()
        self._monitor_thread.start()
        return self

    def stop(self) -> None:
        """SIGKILL every process started here. The watch threads ignore what they still receive
        and end within WATCH_TIMEOUT_S."""
        self._stopped.set()
        with self._lock:
            procs = list(self._procs.values())
            for proc in procs:
                proc.popen.kill()
        if self._monitor_thread.is_alive():
            self._monitor_thread.join()
        for proc in procs:
            proc.popen.wait()
        self._runtime.close()

    def log_path(self, pod_name: str) -> Path:
        return self._log_dir / pod_name / "output.log"

    def log_paths(self, prefix: str) -> list[Path]:
        """The logs of every pod whose name starts with ``prefix`` (a coordinator's
        incarnations, say), in no particular order."""
        return sorted(self._log_dir.glob(f"{prefix}*/output.log"))

    def vanish(self, node: str) -> None:
        """The machine is gone but its Node object lingers, as after a reclaim the cloud has
        not reported yet: everything on it is killed and nothing is reported, ever."""
        self._node_gone(node)

    def home(self, pod_name: str) -> Path:
        """The working directory and HOME of a pod's process: its own, like a container's."""
        return self.log_path(pod_name).parent / "home"

    def process(self, pod_name: str) -> subprocess.Popen | None:
        """The process last started for a pod of that name, also after it ended."""
        with self._lock:
            proc = self._procs.get(pod_name)
        return proc.popen if proc else None

    def _watch(self, list_fn, kwargs: dict, on_list, on_event) -> None:
        """List, then watch from there; on any end or error, start over with a fresh list."""
        from kubernetes import watch

        while not self._stopped.is_set():
            try:
                listing = list_fn(**kwargs)
                on_list(listing.items)
                for event in watch.Watch().stream(list_fn, resource_version=listing.metadata.resource_version,
                                                  timeout_seconds=WATCH_TIMEOUT_S, **kwargs):
                    if self._stopped.is_set():
                        return
                    on_event(event["type"], event["object"])
            except Exception:  # noqa: BLE001 - a watch thread must outlive any API hiccup
                log.exception("local kubelet: %s failed; listing again", list_fn.__name__)
                self._stopped.wait(RETRY_S)

    def _on_pods(self, pods) -> None:
        names = {pod.metadata.name for pod in pods}
        with self._lock:  # pods deleted while the watch was down
            for name, proc in self._procs.items():
                if name not in names:
                    proc.gone = True
                    proc.popen.kill()
        for pod in pods:
            self._on_pod("ADDED", pod)

    def _on_pod(self, kind: str, pod) -> None:
        meta, node = pod.metadata, pod.spec.node_name
        with self._lock:
            proc = self._procs.get(meta.name)
            if proc is not None and (kind == "DELETED" or proc.uid != meta.uid):
                # Deleted outright (forced), or replaced by a new pod of the same name.
                proc.gone = True
                proc.popen.kill()
                proc = None
            if kind == "DELETED" or not node or node in self._dead_nodes:
                return  # gone, unscheduled, or on a node whose kubelet vanished with it
            if meta.deletion_timestamp is not None and proc is not None:
                if not proc.deleting:
                    grace = meta.deletion_grace_period_seconds
                    grace = pod.spec.termination_grace_period_seconds if grace is None else grace
                    proc.deleting = True
                    proc.kill_at = time.monotonic() + min(30 if grace is None else grace, MAX_GRACE_S)
                    proc.popen.terminate()
                return
        if meta.deletion_timestamp is not None:
            self._finish_deletion(meta.name, meta.uid)  # never ran here: nothing to stop
        elif proc is None and pod.status.phase not in ("Succeeded", "Failed"):
            self._start(pod)

    def _start(self, pod) -> None:
        name, container, runtime = pod.metadata.name, pod.spec.containers[0], self._runtime
        try:
            pod_dir = self.log_path(name).parent
            pod_dir.mkdir(parents=True, exist_ok=True)
            addresses = runtime.addresses()
            env = _container_env(pod, container, runtime, addresses, self._secret)
            # The runtime's addresses apply to arguments too: one may be passed either way.
            command, args = ([runtime.address(_expand(arg, env)) for arg in part or []]
                             for part in (container.command, container.args))
            start = runtime.prepare(pod, container, env, command, args, pod_dir, addresses)
            with self._lock:
                if self._stopped.is_set() or pod.spec.node_name in self._dead_nodes:
                    return
                self._procs[name] = _Process(start(self.log_path(name)), pod.metadata.uid,
                                             pod.spec.node_name, container, _now(), addresses)
        except (ValueError, OSError, RuntimeError) as e:
            # The monitor reports Running; a pod that cannot start stays Pending and says why.
            reason = "CreateContainerConfigError" if isinstance(e, _ConfigError) else "CreateContainerError"
            self._core.patch_namespaced_pod_status(name, self._namespace, {"status": {"containerStatuses": [{
                "name": container.name, "image": container.image, "imageID": "", "ready": False,
                "restartCount": 0, "state": {"waiting": {"reason": reason, "message": str(e)}},
            }]}})

    def _secret(self, name: str) -> dict[str, str] | None:
        from kubernetes import client

        try:
            data = self._core.read_namespaced_secret(name, self._namespace).data or {}
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise
        return {k: base64.b64decode(v).decode() for k, v in data.items()}

    def _monitor(self) -> None:
        """One thread for all processes: SIGKILLs after the grace period, reports exits, and
        finishes the deletion of pods whose process has stopped."""
        while not self._stopped.wait(POLL_S):
            actions = []
            with self._lock:  # so a process killed with its node is seen gone, never as Failed
                for name, proc in self._procs.items():
                    if proc.gone:
                        continue
                    code = proc.popen.poll()
                    if code is None and proc.kill_at is not None and time.monotonic() >= proc.kill_at:
                        proc.popen.kill()
                    phase = "Running" if code is None else "Succeeded" if code == 0 else "Failed"
                    if code is not None and proc.deleting:
                        actions.append(partial(self._finish_deletion, name, proc.uid))
                    elif proc.reported != phase:
                        actions.append(partial(self._report, name, proc, phase, code))
            for action in actions:
                try:
                    action()
                except Exception:  # noqa: BLE001 - retried on the next poll
                    log.exception("local kubelet: updating a pod of %s failed", self._namespace)

    def _report(self, name: str, proc: _Process, phase: str, code: int | None) -> None:
        running, now = code is None, _now()
        if running:
            state = {"running": {"startedAt": proc.started_at}}
        else:  # a process killed by signal N exits 128+N in a container
            state = {"terminated": {
                "exitCode": code if code >= 0 else 128 - code, "reason": "Completed" if code == 0 else "Error",
                "startedAt": proc.started_at, "finishedAt": now}}
            if code != 0 and proc.container.termination_message_policy == "FallbackToLogsOnError":
                state["terminated"]["message"] = self._log_tail(name)
        ready = {"status": str(running), "lastTransitionTime": now, "reason": None if running else "PodCompleted"}
        pod_ip, host_ip = proc.addresses.reported_pod, proc.addresses.reported_host
        self._core.patch_namespaced_pod_status(name, self._namespace, {"status": {
            "phase": phase, "podIP": pod_ip, "podIPs": [{"ip": pod_ip}],
            "hostIP": host_ip, "hostIPs": [{"ip": host_ip}], "startTime": proc.started_at,
            "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Initialized", "status": "True"},
                           {"type": "ContainersReady", **ready}, {"type": "Ready", **ready}],
            "containerStatuses": [{"name": proc.container.name, "image": proc.container.image, "imageID": "",
                                   "ready": running, "started": running, "restartCount": 0, "state": state}],
        }})
        proc.reported = phase

    def _log_tail(self, name: str) -> str:
        """What a kubelet puts in a failed container's termination message under
        FallbackToLogsOnError: the log's last 80 lines, at most its last 2048 bytes."""
        try:
            data = self.log_path(name).read_bytes()[-TERMINATION_MESSAGE_BYTES:]
        except OSError:
            return ""
        return "\n".join(data.decode(errors="replace").splitlines()[-TERMINATION_MESSAGE_LINES:])

    def _finish_deletion(self, name: str, uid: str) -> None:
        """What the kubelet does once the pod's containers have stopped: delete it for good."""
        try:  # with a body, the API server ignores the query's grace_period_seconds
            self._core.delete_namespaced_pod(name, self._namespace, body={
                "gracePeriodSeconds": 0, "preconditions": {"uid": uid}})
        except Exception as e:  # 404: already gone; 409: a new pod has taken the name
            if getattr(e, "status", None) not in (404, 409):
                raise
        with self._lock:
            if (proc := self._procs.get(name)) is not None and proc.uid == uid:
                proc.gone = True

    def _on_nodes(self, nodes) -> None:
        names = {node.metadata.name for node in nodes}
        with self._lock:
            self._dead_nodes -= names
            lost = {proc.node for proc in self._procs.values() if not proc.gone and proc.node not in names}
        for node in lost:  # deleted while the watch was down
            self._node_gone(node)

    def _on_node(self, kind: str, node) -> None:
        if kind == "DELETED":
            self._node_gone(node.metadata.name)
        elif kind == "ADDED":
            with self._lock:
                self._dead_nodes.discard(node.metadata.name)

    def _node_gone(self, name: str) -> None:
        # A reclaimed node's kubelet says no goodbye (SIGKILL, no SIGTERM) and reports nothing:
        # the pods' status is left to pod GC and the job's controller.
        with self._lock:
            self._dead_nodes.add(name)
            for proc in self._procs.values():
                if proc.node == name and not proc.gone:
                    proc.gone = True
                    self._runtime.lose(proc.popen)


@pytest.fixture
def local_kubelet(cluster, namespace, tmp_path):
    """A LocalKubelet running pods as processes, for the test's namespace; its pods' logs and
    kubeconfigs under tmp_path."""
    yield from _kubelet(cluster, namespace, tmp_path, ProcessRuntime(cluster.api, namespace))


@pytest.fixture
def container_kubelet(cluster, namespace, tmp_path, images):
    """A LocalKubelet running pods from their images in the local Docker engine, for the
    test's namespace (``images``: the project's, built by hack/images.sh)."""
    from testcluster.containers import ContainerRuntime

    if not cluster.local:
        pytest.skip("the container kubelet serves the local cluster; other clusters have kubelets")
    yield from _kubelet(cluster, namespace, tmp_path, ContainerRuntime(cluster.api, namespace))


def _kubelet(cluster, namespace, tmp_path, runtime):
    kubelet = LocalKubelet(cluster.api, namespace, tmp_path / "kubelet", runtime).start()
    yield kubelet
    kubelet.stop()
    # Nobody would finish the deletion of its pods now, and they would keep the namespace
    # Terminating for good (on nodes that outlive the test).
    cluster.core.delete_collection_namespaced_pod(namespace, label_selector=LABEL, body={"gracePeriodSeconds": 0})


def main(argv: list[str] | None = None) -> int:
    """``python -m testcluster.kubelet --namespace NS --log-dir DIR``: run until interrupted
    (hack/try-on-cluster.sh uses it to run a job's pods on the local cluster)."""
    import argparse
    import signal

    from testcluster.kube import api_client

    parser = argparse.ArgumentParser(prog="python -m testcluster.kubelet", description=main.__doc__)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--log-dir", type=Path, required=True, help="each pod's output.log goes here")
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"))
    parser.add_argument("--containers", action="store_true",
                        help="run each pod from its image in the local Docker engine "
                             "(hack/images.sh build makes the project's images)")
    args = parser.parse_args(argv)
    api = api_client(args.kubeconfig)
    if args.containers:
        from testcluster.containers import ContainerRuntime

        runtime = ContainerRuntime(api, args.namespace)
    else:
        runtime = ProcessRuntime(api, args.namespace)
    kubelet = LocalKubelet(api, args.namespace, args.log_dir, runtime).start()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    kubelet.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
