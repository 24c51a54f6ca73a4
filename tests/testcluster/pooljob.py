"""A LazarusJob for the node pools of hack/nodepools.yaml (the local kwok cluster or kind):
its workers go to the spot GPU pool and its coordinator to the system pool, and its pods carry
the label that the local kubelet (testcluster.kubelet) runs on kwok's nodes (kind's real
kubelets ignore it). Workers need no ServiceAccount; the operator gives the coordinator one.

    python -m testcluster.pooljob examples/tiny-cpu.yaml --namespace NS [--image IMAGE]
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import yaml

from testcluster.kubelet import LABEL
from testcluster.nodepools import POOL_LABEL

SPOT_TOLERATIONS = [
    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "cloud.google.com/gke-spot", "operator": "Exists", "effect": "NoSchedule"},
]


def on_pools(doc: dict, namespace: str, node_labels: dict[str, str] | None = None,
             image: str | None = None) -> dict:
    """``doc`` (a LazarusJob) in ``namespace``; ``node_labels`` narrow the nodes further."""
    doc = copy.deepcopy(doc)
    doc["metadata"] = {"name": doc["metadata"]["name"], "namespace": namespace}
    spec = doc["spec"]
    selector = dict(node_labels or {})
    spec["coordinator"] = {"nodeSelector": selector | {POOL_LABEL: "system"}}
    template = spec.setdefault("template", {})
    template["labels"] = {LABEL: "local"} | template.get("labels", {})
    template["nodeSelector"] = selector | {POOL_LABEL: "gpu-spot"}
    template["tolerations"] = SPOT_TOLERATIONS
    if image:
        template["image"] = image
    resources = template.setdefault("resources", {})
    resources["limits"] = resources.get("limits", {}) | {"nvidia.com/gpu": spec.get("gpusPerNode", 1)}
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testcluster.pooljob", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("manifest", type=Path)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--image", help="the runtime image (kind: one loaded with kind load)")
    args = parser.parse_args(argv)
    doc = yaml.safe_load(args.manifest.read_text())
    yaml.safe_dump(on_pools(doc, args.namespace, image=args.image), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
