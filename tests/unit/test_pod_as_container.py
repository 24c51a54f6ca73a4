"""How the local kubelet's container mode turns a pod into `docker run` (testcluster.containers):
the same rules a kubelet and its runtime apply, checked without an engine."""
from types import SimpleNamespace as NS

import pytest

from testcluster.containers import (PodConfigError, entrypoint_args, resource_args,
                                    security_args, service_names, user_args, volume_mounts)


def flags(args: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for flag, value in zip(args[::2], args[1::2]):
        out.setdefault(flag, []).append(value)
    return out


@pytest.mark.parametrize("command,args,expected", [
    ([], [], ([], [])),  # the image's entrypoint and cmd
    ([], ["--verbose"], ([], ["--verbose"])),  # the image's entrypoint, new cmd
    (["python", "-m", "w"], [], (["--entrypoint", "python"], ["-m", "w"])),  # cmd dropped
    (["python"], ["-m", "w"], (["--entrypoint", "python"], ["-m", "w"])),
])
def test_command_replaces_the_entrypoint_and_args_the_cmd(command, args, expected):
    assert entrypoint_args(command, args) == expected


def test_run_as_user_and_group_override_the_image_and_fs_group_joins_the_groups():
    pod_sc = NS(run_as_user=10001, run_as_group=None, run_as_non_root=True, fs_group=2000,
                supplemental_groups=[3000])
    container_sc = NS(run_as_user=10002, run_as_group=10003)
    assert flags(user_args(pod_sc, container_sc, "10001:10001")) == {
        "--user": ["10002:10003"], "--group-add": ["2000", "3000"]}
    # Nothing asked: the image's USER stands.
    assert user_args(None, None, "10001:10001") == []
    assert user_args(NS(run_as_non_root=True), None, "10001:10001") == []


@pytest.mark.parametrize("pod_sc,image_user,why", [
    (NS(run_as_non_root=True, run_as_user=0), "10001", "runAsUser is 0"),
    (NS(run_as_non_root=True), "", "image will run as root"),
    (NS(run_as_non_root=True), "0:0", "image will run as root"),
    (NS(run_as_non_root=True), "root", "image will run as root"),
    (NS(run_as_non_root=True), "lazarus", r"non-numeric user \(lazarus\)"),
])
def test_run_as_non_root_refuses_what_the_kubelet_refuses(pod_sc, image_user, why):
    with pytest.raises(PodConfigError, match=why):
        user_args(pod_sc, None, image_user)


def test_the_container_wins_over_the_pod_for_run_as_non_root():
    assert user_args(NS(run_as_non_root=True), NS(run_as_non_root=False), "0") == []


def test_security_context_becomes_engine_options():
    sc = NS(read_only_root_filesystem=True, allow_privilege_escalation=False,
            capabilities=NS(drop=["ALL"], add=["NET_BIND_SERVICE"]))
    args = security_args(NS(seccomp_profile=NS(type="RuntimeDefault")), sc)
    assert "--read-only" in args and "--privileged" not in args
    assert flags([a for a in args if a != "--read-only"]) == {
        "--security-opt": ["no-new-privileges"], "--cap-drop": ["ALL"],
        "--cap-add": ["NET_BIND_SERVICE"]}
    assert security_args(None, NS(seccomp_profile=NS(type="Unconfined"))) == [
        "--security-opt", "seccomp=unconfined"]
    with pytest.raises(PodConfigError, match="seccompProfile.type Localhost"):
        security_args(NS(seccomp_profile=NS(type="Localhost")), None)


def test_limits_become_cgroup_limits_and_the_cpu_request_becomes_shares():
    resources = NS(limits={"cpu": "1500m", "memory": "1Gi", "nvidia.com/gpu": "1"},
                   requests={"cpu": "250m"})
    assert flags(resource_args(resources)) == {
        "--cpus": ["1.500"], "--cpu-shares": ["256"],
        "--memory": [str(2**30)], "--memory-swap": [str(2**30)]}
    # A limit alone is also the request; a tiny request gets the kubelet's floor.
    assert flags(resource_args(NS(limits={"cpu": "2"}, requests=None)))["--cpu-shares"] == ["2048"]
    assert flags(resource_args(NS(limits=None, requests={"cpu": "1m"}))) == {"--cpu-shares": ["2"]}
    assert resource_args(None) == []


def _pod(name, labels, hostname=None, subdomain=None):
    return NS(metadata=NS(name=name, namespace="ns", labels=labels),
              spec=NS(hostname=hostname, subdomain=subdomain))


def _service(name, selector, headless=False):
    return NS(metadata=NS(name=name), spec=NS(selector=selector, cluster_ip="None" if headless else "10.0.0.9"))


def test_a_pod_answers_to_the_services_that_select_it_and_its_headless_name():
    services = [_service("coordinator", {"role": "coordinator"}),
                _service("workers", {"role": "worker"}, headless=True),
                _service("everything", {}),  # no selector: selects nothing
                ]
    worker = _pod("job-worker-0", {"role": "worker"}, hostname="job-worker-0", subdomain="workers")
    assert service_names(worker, services) == [
        "workers", "workers.ns", "workers.ns.svc", "workers.ns.svc.cluster.local",
        "job-worker-0.workers", "job-worker-0.workers.ns.svc", "job-worker-0.workers.ns.svc.cluster.local"]
    coordinator = _pod("job-coordinator", {"role": "coordinator"})
    assert service_names(coordinator, services) == [
        "coordinator", "coordinator.ns", "coordinator.ns.svc", "coordinator.ns.svc.cluster.local"]
    # A subdomain names a Service only when that Service is headless.
    stray = _pod("stray", {}, hostname="stray", subdomain="coordinator")
    assert service_names(stray, services) == []


def _volume(name, **source):
    kinds = ("empty_dir", "host_path", "projected", "config_map", "secret")
    return NS(name=name, **{k: source.get(k) for k in kinds})


def _mount(name, path, read_only=None, sub_path=None):
    return NS(name=name, mount_path=path, read_only=read_only, sub_path=sub_path)


def test_volumes_are_host_directories_with_the_kubelets_modes(tmp_path):
    host = tmp_path / "ckpt"
    pod = NS(spec=NS(volumes=[
        _volume("tmp", empty_dir=NS()), _volume("ckpt", host_path=NS(path=str(host), type="DirectoryOrCreate")),
        _volume("token", projected=NS())]))
    container = NS(volume_mounts=[_mount("tmp", "/tmp"), _mount("ckpt", "/ckpt"),
                                  _mount("token", "/var/run/secrets/x", read_only=True)])
    mounts = volume_mounts(pod, container, tmp_path / "pod",
                           lambda volume: {"token": "t0k", "sub/ca.crt": "pem"})
    assert [(m.target, m.read_only) for m in mounts] == [
        ("/tmp", False), ("/ckpt", False), ("/var/run/secrets/x", True)]
    assert mounts[0].source.stat().st_mode & 0o777 == 0o777  # any user may write an emptyDir
    assert mounts[1].source == host and host.is_dir()
    assert (mounts[2].source / "sub" / "ca.crt").read_text() == "pem"
    assert (mounts[2].source / "token").stat().st_mode & 0o777 == 0o644
    assert mounts[2].arg()[1].endswith("target=/var/run/secrets/x,readonly")


@pytest.mark.parametrize("volume,why", [
    (_volume("v", secret=NS()), "only emptyDir, hostPath"),
    (_volume("v", host_path=NS(path="/nonexistent/lazarus", type="Directory")), "does not exist"),
])
def test_a_volume_it_cannot_provide_is_refused_by_name(tmp_path, volume, why):
    pod = NS(spec=NS(volumes=[volume]))
    with pytest.raises(PodConfigError, match=why):
        volume_mounts(pod, NS(volume_mounts=[_mount("v", "/v")]), tmp_path, lambda v: {})
    with pytest.raises(PodConfigError, match="no volume of that name"):
        volume_mounts(NS(spec=NS(volumes=[])), NS(volume_mounts=[_mount("v", "/v")]), tmp_path, lambda v: {})
