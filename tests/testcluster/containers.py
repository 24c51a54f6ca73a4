"""The container mode of the local kubelet (testcluster.kubelet): each pod runs from its image
in the local Docker engine (hack/images.sh starts one and builds the project's images), the
way a kubelet and a container runtime would run it.

What a pod gets:
- its image, never pulled (no registry is reachable; hack/images.sh builds them here), with
  the pod's command and args over the image's entrypoint and cmd, as Kubernetes defines them;
- its environment (expanded by the kubelet), plus KUBERNETES_SERVICE_HOST/PORT; with the
  ServiceAccount volume that admission adds to a pod (a token bound to the pod, the cluster's
  CA, the namespace), the process reaches the API server in-cluster, with exactly its
  ServiceAccount's RBAC;
- its securityContext, pod and container: runAsUser/runAsGroup, runAsNonRoot (checked against
  the image's user, as the kubelet does), readOnlyRootFilesystem, capabilities, no privilege
  escalation, fsGroup and supplementalGroups as extra groups, an unconfined seccomp profile;
- its resources: limits.cpu and limits.memory as cgroup limits, requests.cpu as CPU shares;
- its volumes: emptyDir, hostPath, configMap and projected (tokens, ConfigMaps, fieldRefs);
- its own address on a Docker network of its kubelet, where the DNS names of the Services that
  select it (and hostname.subdomain under a headless Service) resolve to it.

Not supported (a pod asking for them stays Pending with the reason): other volume types,
env from anything but values and fieldRefs, and Localhost seccomp profiles. Names resolve straight to pods, so a Service must send its port to
the same targetPort, as every Service of the project does; no cluster IPs, no kube-proxy.
"""
from __future__ import annotations

import ipaddress
import json
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from testcluster.kubelet import Addresses, field_ref

DOCKER = "docker"
DOCKER_TIMEOUT_S = 60
# The in-cluster address of the API server; its certificate names it (kwokctl's does), and
# each container's /etc/hosts sends it to the host, where the API server listens.
API_SERVICE_HOST = "kubernetes.default.svc"
CONTAINER_LABEL = "lazarus.dev/local-kubelet"
CLUSTER_DOMAIN = "cluster.local"
MIN_CPU_SHARES = 2
# Where the kubelets' pod networks go: far from this host's own routes and Docker's defaults.
SUBNETS = ipaddress.ip_network("10.213.0.0/16")  # the kubelet's floor for a pod that requests (almost) no CPU


class PodConfigError(ValueError):
    """A pod this runtime cannot run as written; the message says which field and why."""


def docker(*args: str, timeout: float = DOCKER_TIMEOUT_S) -> str:
    result = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:2])} failed: {result.stderr.strip()}")
    return result.stdout


def _get(obj, name: str, default=None):
    """A field of a kubernetes client model, None-safe."""
    value = getattr(obj, name, None) if obj is not None else None
    return default if value is None else value


# --- pure translation of a pod into `docker run` arguments ------------------------------

def entrypoint_args(command: list[str], args: list[str]) -> tuple[list[str], list[str]]:
    """Kubernetes' command/args over the image's ENTRYPOINT/CMD, as ``docker run`` options
    and the arguments after the image: a command replaces the entrypoint and drops the
    image's cmd; args alone replace the cmd only."""
    if command:
        return ["--entrypoint", command[0]], command[1:] + args
    return [], list(args)


def user_args(pod_sc, container_sc, image_user: str) -> list[str]:
    """--user and --group-add for the securityContexts (the container's wins), refusing what
    the kubelet refuses under runAsNonRoot."""
    def pick(name):
        value = _get(container_sc, name)
        return _get(pod_sc, name) if value is None else value

    uid, gid, non_root = pick("run_as_user"), pick("run_as_group"), pick("run_as_non_root")
    image_uid = (image_user or "").partition(":")[0]
    if non_root:
        if uid is not None:
            if uid == 0:
                raise PodConfigError("securityContext.runAsUser is 0, and runAsNonRoot forbids root")
        elif image_uid in ("", "0", "root"):
            raise PodConfigError("container has runAsNonRoot and image will run as root: "
                                 "set securityContext.runAsUser, or a non-root USER in the image")
        elif not image_uid.isdigit():
            raise PodConfigError(f"container has runAsNonRoot and image has non-numeric user "
                                 f"({image_uid}), cannot verify user is non-root: set "
                                 f"securityContext.runAsUser")
    out = []
    if uid is not None or gid is not None:
        user = str(uid) if uid is not None else image_uid or "0"
        out += ["--user", user if gid is None else f"{user}:{gid}"]
    groups = [_get(pod_sc, "fs_group")] + list(_get(pod_sc, "supplemental_groups", []))
    for group in groups:
        if group is not None:
            out += ["--group-add", str(group)]
    return out


def security_args(pod_sc, container_sc) -> list[str]:
    """The container-level securityContext (and the pod's seccomp profile) as docker options."""
    out = []
    if _get(container_sc, "read_only_root_filesystem"):
        out.append("--read-only")
    if _get(container_sc, "privileged"):
        out.append("--privileged")
    if _get(container_sc, "allow_privilege_escalation") is False:
        out += ["--security-opt", "no-new-privileges"]
    capabilities = _get(container_sc, "capabilities")
    for cap in _get(capabilities, "drop", []):
        out += ["--cap-drop", cap]
    for cap in _get(capabilities, "add", []):
        out += ["--cap-add", cap]
    profile = _get(container_sc, "seccomp_profile") or _get(pod_sc, "seccomp_profile")
    kind = _get(profile, "type", "RuntimeDefault")
    if kind == "Unconfined":
        out += ["--security-opt", "seccomp=unconfined"]
    elif kind != "RuntimeDefault":  # the engine's default profile is the runtime's default
        raise PodConfigError(f"securityContext.seccompProfile.type {kind} is not supported "
                             f"by the local kubelet (RuntimeDefault or Unconfined)")
    return out


def resource_args(resources) -> list[str]:
    """CPU and memory limits as cgroup limits, the CPU request as shares, like the kubelet;
    extended resources (nvidia.com/gpu) are only the scheduler's business here."""
    from kubernetes.utils.quantity import parse_quantity

    limits, requests = _get(resources, "limits", {}), _get(resources, "requests", {})
    out = []
    if "cpu" in limits:
        out += ["--cpus", str(parse_quantity(limits["cpu"]))]
    cpu_request = requests.get("cpu", limits.get("cpu"))
    if cpu_request is not None:
        shares = int(parse_quantity(cpu_request) * 1024)
        out += ["--cpu-shares", str(max(MIN_CPU_SHARES, shares))]
    if "memory" in limits:
        memory = int(parse_quantity(limits["memory"]).to_integral_value())
        out += ["--memory", str(memory), "--memory-swap", str(memory)]
    return out


def _selects(service, labels: dict) -> bool:
    selector = _get(service.spec, "selector", {})
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def service_names(pod, services) -> list[str]:
    """The DNS names that reach this pod: every form of the name of each Service selecting it,
    and hostname.subdomain under the headless Service named by the pod's subdomain."""
    ns, labels = pod.metadata.namespace, pod.metadata.labels or {}
    names = []
    for service in services:
        svc = service.metadata.name
        if _selects(service, labels):
            names += [svc, f"{svc}.{ns}", f"{svc}.{ns}.svc", f"{svc}.{ns}.svc.{CLUSTER_DOMAIN}"]
        if pod.spec.hostname and svc == pod.spec.subdomain and service.spec.cluster_ip == "None":
            fqdn = f"{pod.spec.hostname}.{svc}.{ns}.svc"
            names += [f"{pod.spec.hostname}.{svc}", fqdn, f"{fqdn}.{CLUSTER_DOMAIN}"]
    return list(dict.fromkeys(names))


@dataclass(frozen=True)
class Mount:
    source: Path
    target: str
    read_only: bool = False

    def arg(self) -> list[str]:
        spec = f"type=bind,source={self.source},target={self.target}"
        return ["--mount", spec + (",readonly" if self.read_only else "")]


def volume_mounts(pod, container, pod_dir: Path, files) -> list[Mount]:
    """The container's volumeMounts, each backed by a directory on this host: emptyDir a fresh
    one under ``pod_dir`` (mode 0777, as the kubelet makes it), hostPath the path itself, and
    projected and configMap volumes one holding ``files(volume)`` ({path: text}, mode 0644)."""
    volumes = {v.name: v for v in pod.spec.volumes or []}
    mounts = []
    for vm in container.volume_mounts or []:
        volume = volumes.get(vm.name)
        if volume is None:
            raise PodConfigError(f"volumeMounts {vm.name}: the pod has no volume of that name")
        source = pod_dir / "volumes" / vm.name
        if volume.empty_dir is not None:
            source.mkdir(parents=True, exist_ok=True)
            source.chmod(0o777)
        elif volume.host_path is not None:
            source = Path(volume.host_path.path)
            if volume.host_path.type in (None, "", "DirectoryOrCreate"):
                source.mkdir(parents=True, exist_ok=True)
            elif not source.exists():
                raise PodConfigError(f"volume {vm.name}: hostPath {source} does not exist")
        elif volume.projected is not None or volume.config_map is not None:
            for path, text in files(volume).items():
                (source / path).parent.mkdir(parents=True, exist_ok=True)
                (source / path).write_text(text)
                (source / path).chmod(0o644)  # the default mode of both
        else:
            raise PodConfigError(f"volume {vm.name}: only emptyDir, hostPath, configMap and "
                                 f"projected volumes are supported by the local kubelet")
        if vm.sub_path:
            source = source / vm.sub_path
            source.mkdir(parents=True, exist_ok=True)
        mounts.append(Mount(source, vm.mount_path, bool(vm.read_only)))
    return mounts


# --- the engine side ------------------------------------------------------------------------

def image_user(image: str) -> str:
    """The image's USER, or raises PodConfigError if the image is not here (never pulled)."""
    try:
        config = json.loads(docker("image", "inspect", "--format", "{{json .Config}}", image))
    except RuntimeError:
        raise PodConfigError(f"image {image} is not in the local engine, and the local kubelet "
                             f"never pulls: build it (hack/images.sh build)") from None
    return config.get("User") or ""


class PodNetwork:
    """A Docker network for one kubelet's pods: an address each, and Service names as aliases.
    Its subnet is chosen here (the engine assigns fixed addresses only in such networks), the
    first /24 of SUBNETS that no other network holds."""

    def __init__(self, name: str, namespace: str):
        self.name = name
        for subnet in SUBNETS.subnets(new_prefix=24):
            created = subprocess.run(
                [DOCKER, "network", "create", "--subnet", str(subnet), "--label",
                 f"{CONTAINER_LABEL}={namespace}", name], capture_output=True, text=True,
                timeout=DOCKER_TIMEOUT_S)
            if created.returncode == 0:
                break
            if "overlap" not in created.stderr:
                raise RuntimeError(f"docker network create failed: {created.stderr.strip()}")
        else:
            raise RuntimeError(f"every /24 of {SUBNETS} is taken by another Docker network")
        self.subnet = subnet
        hosts = (str(ip) for ip in subnet.hosts())
        self.gateway = next(hosts)  # the engine's own address on it: this host
        self._hosts = hosts

    def allocate(self) -> str:
        """A fresh address (never reused while the network lives: a dead pod's peers may still
        hold its address)."""
        return next(self._hosts)

    def remove(self) -> None:
        subprocess.run([DOCKER, "network", "rm", self.name], capture_output=True, timeout=DOCKER_TIMEOUT_S)


class Container:
    """A pod's container, run attached: its ``docker run`` process is the handle (and streams
    the output to the log), like the Popen of process mode. Signals go to the container."""

    def __init__(self, name: str, argv: list[str], log_path: Path, network: str):
        self.name, self.network = name, network
        with open(log_path, "ab") as out:
            self._popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                           stderr=subprocess.STDOUT)
        self._signals: list[subprocess.Popen] = []

    def poll(self) -> int | None:
        return self._popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        code = self._popen.wait(timeout)
        for p in self._signals:
            p.wait(timeout)
        return code

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def _docker(self, *commands: list[str]) -> None:
        """Runs the docker commands one after the other, in the background: the kubelet signals
        while holding its lock. Reaped by wait()."""
        script = "; ".join(" ".join([DOCKER, *command]) for command in commands)
        self._signals = [p for p in self._signals if p.poll() is None]
        self._signals.append(subprocess.Popen(["sh", "-c", script], stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL))

    def send_signal(self, sig: int) -> None:
        self._docker(self._kill(sig))

    def _kill(self, sig: int) -> list[str]:
        return ["kill", "--signal", signal.Signals(sig).name, self.name]

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def vanish(self) -> None:
        """What a reclaimed node does to its pods: off the network first, so that no peer hears
        a connection close, then killed."""
        self._docker(["network", "disconnect", "--force", self.network, self.name],
                     self._kill(signal.SIGKILL))


def run_argv(*, name: str, image: str, namespace: str, hostname: str, network: str, ip: str,
             aliases: list[str], api_gateway: str, env: dict[str, str], mounts: list[Mount],
             options: list[str], command: list[str], args: list[str], working_dir: str | None) -> list[str]:
    """The whole ``docker run`` command for one container (attached; removed once it exits)."""
    entrypoint, after = entrypoint_args(command, args)
    argv = [DOCKER, "run", "--rm", "--pull", "never", "--sig-proxy=false", "--name", name,
            "--label", f"{CONTAINER_LABEL}={namespace}", "--hostname", hostname,
            "--network", network, "--ip", ip, "--add-host", f"{API_SERVICE_HOST}:{api_gateway}"]
    for alias in aliases:
        argv += ["--network-alias", alias]
    for key, value in env.items():
        argv += ["--env", f"{key}={value}"]
    for mount in mounts:
        argv += mount.arg()
    if working_dir:
        argv += ["--workdir", working_dir]
    return argv + options + entrypoint + [image] + after


class ContainerRuntime:
    """The local kubelet's container runtime for one namespace (see the module docstring)."""

    def __init__(self, api, namespace: str):
        from kubernetes import client

        self._api, self._core, self._namespace = api, client.CoreV1Api(api), namespace
        self._network = PodNetwork(f"lazarus-kubelet-{namespace}", namespace)
        self._api_port = str(urlparse(api.configuration.host).port or 443)

    def addresses(self) -> Addresses:
        """A pod's own address; its node's is the network's gateway, this host."""
        ip, node = self._network.allocate(), self._network.gateway
        return Addresses(ip, node, ip, node)

    def base_env(self) -> dict[str, str]:
        """What every container gets before its own env (which may refer to it)."""
        return {"KUBERNETES_SERVICE_HOST": API_SERVICE_HOST, "KUBERNETES_SERVICE_PORT": self._api_port,
                "KUBERNETES_SERVICE_PORT_HTTPS": self._api_port}

    @staticmethod
    def address(value: str) -> str:
        return value  # the network's DNS resolves Service names

    def prepare(self, pod, container, env: dict[str, str], command: list[str], args: list[str],
                pod_dir: Path, addresses: Addresses):
        """Checks, files and API calls (Services, tokens, ConfigMaps); returns the start."""
        sc, pod_sc = container.security_context, pod.spec.security_context
        options = (user_args(pod_sc, sc, image_user(container.image)) + security_args(pod_sc, sc)
                   + resource_args(container.resources))
        mounts = volume_mounts(pod, container, pod_dir,
                               lambda volume: self._volume_files(pod, volume, addresses))
        services = self._core.list_namespaced_service(self._namespace).items
        name = f"{self._network.name}-{pod.metadata.name}-{pod.metadata.uid[:8]}"
        argv = run_argv(
            name=name, image=container.image, namespace=self._namespace,
            hostname=pod.spec.hostname or pod.metadata.name, network=self._network.name,
            ip=addresses.pod, aliases=service_names(pod, services), api_gateway=self._network.gateway,
            env=env, mounts=mounts, options=options, command=command, args=args,
            working_dir=container.working_dir)
        return lambda log_path: Container(name, argv, log_path, self._network.name)

    def _volume_files(self, pod, volume, addresses: Addresses) -> dict[str, str]:
        """The files of a configMap or projected volume, from the API: among them the
        ServiceAccount token, CA and namespace that admission adds to every pod."""
        from testcluster.kube import pod_token

        def config_map(source) -> dict[str, str]:
            data = self._core.read_namespaced_config_map(source.name, self._namespace).data or {}
            items = source.items or [type("Item", (), {"key": k, "path": k}) for k in data]
            return {item.path: data[item.key] for item in items}

        if volume.config_map is not None:
            return config_map(volume.config_map)
        files = {}
        for source in volume.projected.sources or []:
            if source.service_account_token is not None:
                token = source.service_account_token
                files[token.path] = pod_token(self._core, pod, token.expiration_seconds or 3600,
                                              token.audience)
            elif source.config_map is not None:
                files |= config_map(source.config_map)
            elif source.downward_api is not None:
                for item in source.downward_api.items or []:
                    if item.field_ref is None:
                        raise PodConfigError(f"volume {volume.name}: only fieldRef items of "
                                             f"downwardAPI are supported by the local kubelet")
                    files[item.path] = field_ref(pod, item.field_ref.field_path, addresses)
            else:
                raise PodConfigError(f"volume {volume.name}: only serviceAccountToken, "
                                     f"configMap and downwardAPI projections are supported")
        return files

    @staticmethod
    def lose(handle: Container) -> None:
        handle.vanish()

    def close(self) -> None:
        """Every container of this namespace gone (also one whose docker CLI died), then the
        network."""
        listed = subprocess.run([DOCKER, "ps", "-aq", "--filter", f"label={CONTAINER_LABEL}={self._namespace}"],
                                capture_output=True, text=True, timeout=DOCKER_TIMEOUT_S).stdout.split()
        if listed:
            subprocess.run([DOCKER, "rm", "--force", *listed], capture_output=True, timeout=DOCKER_TIMEOUT_S)
        self._network.remove()
