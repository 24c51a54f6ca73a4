"""Fixtures for the operator's tests on the real control plane (tests/testcluster).

``operator`` starts ``python -m lazarus_operator`` as a real subprocess against the test's
API server, watching only the test's namespace; ``make_job`` builds a LazarusJob that lands
on the test's own scratch nodes, so faults injected into them touch no other test.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from jobkit import JobClient
from testcluster.waits import wait_until

ROOT = Path(__file__).resolve().parents[2]
OPERATOR_STOP_TIMEOUT_S = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def lazarus_crds(cluster):
    """The chart's CRDs (LazarusJob and kopf's peering), applied and Established."""
    from kubernetes import client

    ext = client.ApiextensionsV1Api(cluster.api)
    for path in sorted((ROOT / "helm" / "lazarus" / "crds").glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            name = crd["metadata"]["name"]
            try:
                current = ext.read_custom_resource_definition(name)
                crd["metadata"]["resourceVersion"] = current.metadata.resource_version
                ext.replace_custom_resource_definition(name, crd)
            except client.ApiException as e:
                if e.status != 404:
                    raise
                ext.create_custom_resource_definition(crd)
            wait_until(lambda name=name: any(
                c.type == "Established" and c.status == "True"
                for c in ext.read_custom_resource_definition(name).status.conditions or []),
                timeout=30, what=f"CRD {name} to be Established")
    return True


@dataclass
class Operator:
    """One operator process; its log is attached to a failing test's report."""
    args: list[str]
    kubeconfig: Path
    log_path: Path
    metrics_port: int
    proc: subprocess.Popen | None = None
    starts: int = 0
    _logs: list = field(default_factory=list)

    def start(self) -> "Operator":
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        log = open(self.log_path, "a")
        log.write(f"\n===== start {self.starts}: {' '.join(self.args)}\n")
        log.flush()
        self._logs.append(log)
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lazarus_operator", *self.args,
             f"--metrics-port={self.metrics_port}", "--liveness=", "--start-grace-seconds=2"],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        wait_until(self._serving, timeout=30, what="the operator's metrics endpoint",
                   describe=self.tail)
        return self

    def _serving(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the operator exited with {self.proc.returncode}: {self.tail()}")
        try:
            self.metrics()
            return True
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: no cleanup, as when a node under the operator dies."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=OPERATOR_STOP_TIMEOUT_S)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=OPERATOR_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()
        for log in self._logs:
            log.close()

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def metric(self, name: str, **labels) -> float:
        """The value of one sample (0.0 when the series does not exist yet)."""
        for line in self.metrics().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                if all(f'{k}="{v}"' in line for k, v in labels.items()):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


@pytest.fixture
def operator_factory(cluster, namespace, lazarus_crds, tmp_path):
    """``make(kubeconfig=None, peering=None, extra_args=(), watch=None) -> Operator`` (not
    started; ``watch``: another namespace than the test's), stopped afterwards."""
    made: list[Operator] = []

    def make(kubeconfig: Path | None = None, peering: str | None = None,
             extra_args: tuple[str, ...] = (), watch: str | None = None) -> Operator:
        args = [f"--namespace={watch or namespace}", *extra_args]
        args += [f"--peering={peering}"] if peering else ["--standalone"]
        op = Operator(args, kubeconfig or cluster.kubeconfig, tmp_path / f"operator-{len(made)}.log",
                      free_port())
        cluster.log_files[f"operator-{len(made)}"] = op.log_path
        made.append(op)
        return op

    make.made = made
    yield make
    for op in made:
        op.stop()


@pytest.fixture
def operator(operator_factory):
    return operator_factory().start()


@pytest.fixture
def jobs(cluster, namespace):
    from kubernetes import client

    return JobClient(client.CustomObjectsApi(cluster.api), cluster.core, namespace)


