"""Helpers for the operator's cluster tests: a LazarusJob client, a job builder, kubectl."""
from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from lazarus_core.cluster_contract import GROUP, PLURAL, VERSION, read_plan_configmap

from testcluster.pooljob import SPOT_TOLERATIONS
from testcluster.waits import wait_until

CACHE = Path(os.environ.get("LAZARUS_CACHE", Path.home() / ".cache" / "lazarus"))


def tool(name: str) -> Path | None:
    """A binary the control-plane scripts cached (kubectl, helm), newest version first."""
    found = sorted(CACHE.glob(f"tools/*/{name}"), reverse=True)
    return found[0] if found else None


@dataclass
class JobClient:
    custom: object
    core: object
    namespace: str

    def create(self, job: dict) -> dict:
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, job)

    def get(self, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)

    def patch(self, name: str, patch: dict) -> dict:
        return self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL,
                                                          name, patch)

    def status(self, name: str) -> dict:
        return self.get(name).get("status") or {}

    def condition(self, name: str, ctype: str) -> dict:
        return next((c for c in self.status(name).get("conditions", []) if c["type"] == ctype), {})

    def plan(self, name: str) -> dict | None:
        """The published plan (JSON)."""
        from kubernetes import client

        try:
            cm = self.core.read_namespaced_config_map(f"{name}-plan", self.namespace)
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise
        return read_plan_configmap(cm.data)[0].to_dict()

    def generation(self, name: str) -> int:
        plan = self.plan(name)
        return plan["generation"] if plan else 0

    def plan_nodes(self, name: str) -> list[str]:
        plan = self.plan(name)
        return [n["name"] for n in plan["nodes"]] if plan else []

    def wait_generation(self, name: str, generation: int, timeout: float = 30) -> dict:
        return wait_until(
            lambda: (p := self.plan(name)) and p["generation"] >= generation and p,
            timeout=timeout, what=f"plan generation {generation} of job {name}",
            describe=lambda: f"generation {self.generation(name)}, status {self.status(name)}")

    def workers(self, name: str) -> list:
        pods = self.core.list_namespaced_pod(
            self.namespace, label_selector=f"lazarus.dev/job={name},lazarus.dev/role=worker").items
        return [p for p in pods if p.metadata.deletion_timestamp is None]

    def events(self, name: str) -> list:
        return [e for e in self.core.list_namespaced_event(self.namespace).items
                if e.involved_object.name == name and e.involved_object.kind == "LazarusJob"]


def make_job(name: str, namespace: str, **spec) -> dict:
    """A LazarusJob whose workers land only on this test's scratch GPU nodes."""
    base = {
        "runtime": {"model": "tiny", "experts": 4, "layers": 2},
        "minNodes": 2, "maxNodes": 4, "gpusPerNode": 1, "slotsPerGpu": 4, "minReplicas": 2,
        "checkpoint": {"path": "/ckpt", "everySteps": 10},
        "template": {
            "image": "lazarus-runtime:test",
            "resources": {"limits": {"nvidia.com/gpu": 1}},
            "nodeSelector": {"lazarus.dev/scratch": namespace},
            "tolerations": SPOT_TOLERATIONS,
        },
    }
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = base[key] | value
        else:
            base[key] = value
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "LazarusJob",
            "metadata": {"name": name, "namespace": namespace}, "spec": base}


def kubectl(cluster, *args: str, timeout: float = 30) -> str:
    binary = tool("kubectl")
    if binary is None:
        pytest.skip("kubectl is not cached; run hack/build-control-plane.sh")
    result = subprocess.run([str(binary), f"--kubeconfig={cluster.kubeconfig}", *args],
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr
    return result.stdout


def settle(seconds: float) -> None:
    """Give the operator time to do something it should not (a duplicate, a retry storm)."""
    time.sleep(seconds)
