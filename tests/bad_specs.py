"""Malformed LazarusJobs, one table for the spec parser (tests/unit/test_job_spec.py) and for
the real API server and operator (tests/operator/test_bad_specs.py), so both are held to
the same cases: each must be refused by the parser, naming ``field``; the API server must
refuse the ``ADMISSION`` ones naming the same field, and accept the ``CONDITION`` ones,
which the operator must then mark Ready=False with ``reason``.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import pytest

ADMISSION, CONDITION = "admission", "condition"


@dataclass(frozen=True)
class BadSpec:
    id: str
    change: Callable[[dict], None]  # edits a valid manifest in place
    field: str  # the manifest path both the parser and the API server must name
    where: str  # ADMISSION or CONDITION
    reason: str = ""  # the condition's reason, for CONDITION cases

    def apply(self, manifest: dict) -> dict:
        doc = copy.deepcopy(manifest)
        self.change(doc)
        return doc


def _spec(**values) -> Callable[[dict], None]:
    return lambda doc: doc["spec"].update(values)


def _runtime(**values) -> Callable[[dict], None]:
    return lambda doc: doc["spec"]["runtime"].update(values)


def _template(**values) -> Callable[[dict], None]:
    return lambda doc: doc["spec"].setdefault("template", {}).update(values)


def _name(name: str) -> Callable[[dict], None]:
    return lambda doc: doc["metadata"].update(name=name)


def _without(section: str, key: str) -> Callable[[dict], None]:
    return lambda doc: (doc["spec"] if section == "spec" else doc["spec"][section]).pop(key)


def _drop_replicas_then(**values) -> Callable[[dict], None]:
    def change(doc):
        doc["spec"].pop("replicas", None)
        doc["spec"].update(values)
    return change


CASES = [
    # Names the job's Services and pods cannot carry.
    BadSpec("name starting with a digit", _name("1job"), "metadata.name", ADMISSION),
    BadSpec("name with a dot", _name("my.job"), "metadata.name", ADMISSION),
    BadSpec("unicode name", _name("jöb"), "metadata.name", ADMISSION),
    BadSpec("name over 40 characters", _name("j" * 41), "metadata.name", ADMISSION),
    # Resource quantities.
    BadSpec("requests as a bare string", _template(resources={"requests": "8"}),
            "spec.template.resources.requests", ADMISSION),
    BadSpec("cpu of lots", _template(resources={"requests": {"cpu": "lots"}}),
            "spec.template.resources.requests", ADMISSION),
    BadSpec("negative memory", _template(resources={"limits": {"memory": "-1Gi"}}),
            "spec.template.resources.limits", ADMISSION),
    BadSpec("request above its limit",
            _template(resources={"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}),
            "spec.template.resources.requests", CONDITION, "InvalidResources"),
    BadSpec("half a GPU", _template(resources={"limits": {"nvidia.com/gpu": "0.5"}}),
            "spec.template.resources.limits", CONDITION, "InvalidResources"),
    BadSpec("GPU request unlike gpusPerNode",
            _template(resources={"limits": {"nvidia.com/gpu": 4}}),
            "spec.template.resources.limits", CONDITION, "GpuRequestMismatch"),
    BadSpec("coordinator cpu of lots", _spec(coordinator={"resources": {"requests": {"cpu": "x"}}}),
            "spec.coordinator.resources.requests", ADMISSION),
    # spec.runtime, as the workers read it.
    BadSpec("unknown model", _runtime(model="gpt-xl"), "spec.runtime.model", ADMISSION),
    BadSpec("heads that do not divide dim", _runtime(dim=30, heads=4), "spec.runtime.heads",
            ADMISSION),
    BadSpec("heads that do not divide the named model's dim", _runtime(heads=5),
            "spec.runtime.heads", CONDITION, "InvalidRuntime"),
    BadSpec("learning rate abc", _runtime(learningRate="abc"), "spec.runtime.learningRate",
            ADMISSION),
    BadSpec("learning rate as a float", _runtime(learningRate=0.001),
            "spec.runtime.learningRate", ADMISSION),
    BadSpec("dim of a billion", _runtime(dim=1_000_000_000), "spec.runtime.dim", ADMISSION),
    BadSpec("a model no accelerator can hold", _runtime(dim=65536, heads=64, ffnDim=262144),
            "spec.runtime", CONDITION, "ModelTooLarge"),
    BadSpec("topK of 3", _runtime(topK=3), "spec.runtime.topK", ADMISSION),
    BadSpec("a misspelt runtime field", _runtime(topk=2), "spec.runtime", CONDITION,
            "InvalidRuntime"),
    BadSpec("negative seed", _runtime(seed=-1), "spec.runtime.seed", ADMISSION),
    BadSpec("a batch smaller than the ranks", _runtime(globalBatch=2),
            "spec.runtime.globalBatch", ADMISSION),
    # Numbers: negative, huge, not integers.
    BadSpec("negative minNodes", _spec(minNodes=-1), "spec.minNodes", ADMISSION),
    BadSpec("a trillion nodes", _drop_replicas_then(maxNodes=10**12), "spec.maxNodes",
            ADMISSION),
    BadSpec("a fractional GPU count", _spec(gpusPerNode=1.5), "spec.gpusPerNode", ADMISSION),
    BadSpec("steps as a string", _spec(steps="100"), "spec.steps", ADMISSION),
    BadSpec("a trillion steps", _spec(steps=10**12), "spec.steps", ADMISSION),
    BadSpec("gain over 100 percent", _spec(rebalanceMinGainPercent=101),
            "spec.rebalanceMinGainPercent", ADMISSION),
    BadSpec("a negative move price", _spec(movePricePercent=-1), "spec.movePricePercent",
            ADMISSION),
    BadSpec("a move price as a fraction", _spec(movePricePercent=0.5),
            "spec.movePricePercent", ADMISSION),
    # Shapes and ranges.
    BadSpec("no minNodes", _without("spec", "minNodes"), "spec.minNodes", ADMISSION),
    BadSpec("no experts", _without("runtime", "experts"), "spec.runtime.experts", ADMISSION),
    BadSpec("topK above the experts", _runtime(experts=1, topK=2), "spec.runtime.topK",
            ADMISSION),
    BadSpec("f of zero", _spec(minReplicas=0), "spec.minReplicas", ADMISSION),
    BadSpec("too few slots for f", _drop_replicas_then(maxNodes=2, minNodes=1, slotsPerGpu=1,
                                                       minReplicas=3),
            "spec.maxNodes", ADMISSION),
    BadSpec("replicas beyond maxNodes", _spec(replicas=9), "spec.replicas", ADMISSION),
    BadSpec("a GPU count in words", _spec(gpusPerNode="eight"), "spec.gpusPerNode", ADMISSION),
    BadSpec("minNodes above maxNodes", _drop_replicas_then(minNodes=5, maxNodes=4),
            "spec.minNodes", ADMISSION),
    BadSpec("unknown placement", _spec(placement="random"), "spec.placement", ADMISSION),
    BadSpec("an invalid label value", _template(labels={"team": "a b"}),
            "spec.template.labels", CONDITION, "InvalidLabel"),
    # Checkpoints: relative paths, and paths that climb out of their directory.
    BadSpec("relative checkpoint path", _spec(checkpoint={"path": "ckpt/run1"}),
            "spec.checkpoint.path", ADMISSION),
    BadSpec("checkpoint path traversal", _spec(checkpoint={"path": "/ckpt/../../etc"}),
            "spec.checkpoint.path", ADMISSION),
]

def params() -> list:
    """The table as pytest params, each named by its case."""
    return [pytest.param(case, id=case.id) for case in CASES]
