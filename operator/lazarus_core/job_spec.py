"""The LazarusJob spec: parsed and checked once, for the operator and the local backend alike.

The CRD's schema and CEL rules reject most bad specs at admission, but the local backend has
no API server, and some rules cannot be written in the schema (the named model's sizes, the
memory a rank needs). So every rule lives here too: ``spec.runtime`` is checked by the
workers' own parser (runtime_config.py), what goes into pods by pod_template.py, and each
violation names the manifest field, says what is wrong and how to fix it, and carries a
CamelCase reason for a status condition. tests/operator/test_bad_specs.py runs the same bad
specs through this parser and the real API server, and checks that they agree.

Defaults and bounds here must equal the CRD's ``default:``, ``minimum:`` and ``maximum:``
values; tests/unit/test_job_spec.py checks that they do.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from . import kube_names
from .balance import MOVE_PRICE
from .checkpoint_location import KEEP_DEFAULT, KEEP_MAX, KEEP_MIN, path_problem
from .plan import POLICIES
from .pod_template import check_coordinator, check_template
from .runtime_config import (MODEL_LIMITS, TRAINING_BYTES_PER_PARAMETER, RuntimeConfig,
                             split_error)
# The parser's vocabulary, for its callers: one import gives the parser and its errors.
from .spec_reader import SpecError, SpecReader, Violation  # noqa: F401

API_VERSION = "lazarus.dev/v1alpha1"
KIND = "LazarusJob"

# Taints that announce a spot reclaim while the node is still alive.
DEFAULT_SPOT_NOTICE_TAINTS = (
    # aws-node-termination-handler: spot interruption notice, rebalance recommendation and
    # ASG termination, each two minutes or less before the instance goes.
    "aws-node-termination-handler/spot-itn",
    "aws-node-termination-handler/rebalance-recommendation",
    "aws-node-termination-handler/asg-lifecycle-termination",
    # Karpenter (v1) taints a node it is about to disrupt, spot interruptions included.
    "karpenter.sh/disrupted",
    # GKE taints a Spot VM's node when the preemption notice arrives.
    "cloud.google.com/impending-node-termination",
)

DEFAULTS = {
    "gpusPerNode": 1,
    "slotsPerGpu": 1,
    "minReplicas": 2,
    "placement": "mro",
    "rebalanceEverySteps": 200,
    "rebalanceMinGainPercent": 10,
    "movePricePercent": round(MOVE_PRICE * 100),
    "checkpointEverySteps": 50,
    "checkpointKeep": KEEP_DEFAULT,
}

# (minimum, maximum) of each integer field of ``spec``. 10,000 nodes is twice the largest
# cluster Kubernetes supports (5,000 nodes); a billion steps is decades of training.
LIMITS = {
    "minNodes": (1, 10000), "maxNodes": (1, 10000), "replicas": (1, 10000),
    "gpusPerNode": (1, 64), "slotsPerGpu": (1, 256), "minReplicas": (1, 64),
    "rebalanceEverySteps": (0, 10**9), "rebalanceMinGainPercent": (0, 100),
    # 1,000%: moving every slot weighs as ranks 11 times busier, a re-plan that moves least.
    "movePricePercent": (0, 1000),
    "steps": (1, 10**9),
}
# Pod and Service names are derived from the job's ("<job>-coordinator", "<job>-worker-N");
# 40 characters leave room for the longest suffix within a 63-character DNS label.
MAX_NAME_LENGTH = 40
# The most memory of any accelerator (AMD MI355X and NVIDIA B300: 288 GB of HBM3E, 2025).
# A rank whose training state alone exceeds it fits no node.
MAX_RANK_BYTES = 288 * 2**30


@dataclass(frozen=True)
class CheckpointSpec:
    path: str
    every_steps: int
    # Complete checkpoints kept; older ones are deleted.
    keep: int = KEEP_DEFAULT
    # A Secret in the job's namespace whose keys become the workers' environment: the
    # storage credentials (AWS_ACCESS_KEY_ID, ..., or fsspec's FSSPEC_GCS), never in the spec.
    secret_name: str | None = None


@dataclass(frozen=True)
class JobSpec:
    """What the controller needs from ``spec``; pod-level details stay in ``template``."""

    experts: int
    layers: int
    min_nodes: int
    max_nodes: int
    # Desired node count (the scale subresource); the job grows toward it as capacity allows.
    replicas: int
    gpus_per_node: int
    slots_per_gpu: int
    min_replicas: int
    policy: str
    rebalance_every_steps: int  # 0 turns rebalancing off
    # Rebalance only if the busiest rank's measured load over the mean improves by this
    # many percent (controller.transitions._rebalance).
    rebalance_min_gain_percent: int
    checkpoint: CheckpointSpec | None
    # What a re-plan pays to copy expert state: moving every slot weighs as ranks this many
    # percent busier (balance.cheapest).
    move_price_percent: int = DEFAULTS["movePricePercent"]
    spot_notice_taints: tuple[str, ...] = DEFAULT_SPOT_NOTICE_TAINTS
    runtime: Mapping = field(default_factory=dict)
    template: Mapping = field(default_factory=dict)
    # Where the coordinator pod runs (nodeSelector, tolerations, resources).
    coordinator: Mapping = field(default_factory=dict)
    # Train this many steps, then finish; None: until the job is deleted.
    steps: int | None = None

    @property
    def slots_per_node(self) -> int:
        return self.gpus_per_node * self.slots_per_gpu

    @property
    def fewest_nodes(self) -> int:
        """The fewest nodes the job trains on: minNodes, or more if f needs more slots."""
        return max(self.min_nodes, math.ceil(self.experts * self.min_replicas / self.slots_per_node))

    @property
    def target_nodes(self) -> int:
        return max(self.min_nodes, min(self.replicas, self.max_nodes))


def parse_manifest(doc: object) -> tuple[str, JobSpec]:
    """(name, spec) of a whole LazarusJob document, as `kubectl apply`, `lazarus run` or the
    operator (the object the API server holds) read it."""
    if not isinstance(doc, Mapping):
        raise SpecError([Violation("", "InvalidManifest", "the manifest must be a YAML object")])
    problems = []
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != KIND:
        problems.append(Violation(
            "apiVersion", "InvalidManifest",
            f"expected apiVersion {API_VERSION} and kind {KIND}, got "
            f"{doc.get('apiVersion')!r} and {doc.get('kind')!r}"))
    meta = doc.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    why = (kube_names.dns_1035_label(name, MAX_NAME_LENGTH) if isinstance(name, str)
           else "is required")
    if why:
        problems.append(Violation(
            "metadata.name", "InvalidName",
            f"{why}; the job's pod and Service names are derived from it"))
    try:
        spec = parse_spec(doc.get("spec"))
    except SpecError as e:
        problems.extend(e.violations)
    if problems:
        raise SpecError(problems)
    return name, spec


def parse_spec(spec: object) -> JobSpec:
    """A checked JobSpec from a manifest's ``spec``, or SpecError listing every violation."""
    p = SpecReader()
    if not isinstance(spec, Mapping):
        raise SpecError([Violation("spec", "InvalidSpec", "must be an object")])
    runtime = spec.get("runtime", {})
    if not isinstance(runtime, Mapping):
        p.bad("spec.runtime", "InvalidRuntime", "must be an object of runtime arguments")
        runtime = {}
    # Placement needs these two, so the spec must say them even where a named model would.
    experts = p.integer(runtime, "spec.runtime", "experts", None, minimum=1,
                        maximum=MODEL_LIMITS["experts"])
    layers = p.integer(runtime, "spec.runtime", "layers", None, minimum=1,
                       maximum=MODEL_LIMITS["layers"])
    min_nodes = _bounded(p, spec, "minNodes", None)
    max_nodes = _bounded(p, spec, "maxNodes", None)
    # Desired nodes default to maxNodes; with maxNodes invalid, only its own error shows.
    replicas = (_bounded(p, spec, "replicas", max_nodes)
                if "replicas" in spec or max_nodes else None)
    gpus = _bounded(p, spec, "gpusPerNode", DEFAULTS["gpusPerNode"])
    slots = _bounded(p, spec, "slotsPerGpu", DEFAULTS["slotsPerGpu"])
    f = _bounded(p, spec, "minReplicas", DEFAULTS["minReplicas"])
    policy = spec.get("placement", DEFAULTS["placement"])
    if policy not in POLICIES:
        p.bad("spec.placement", "InvalidPlacement",
              f"must be one of {', '.join(POLICIES)}, got {policy!r}")
    every = _bounded(p, spec, "rebalanceEverySteps", DEFAULTS["rebalanceEverySteps"])
    gain = _bounded(p, spec, "rebalanceMinGainPercent", DEFAULTS["rebalanceMinGainPercent"])
    price = _bounded(p, spec, "movePricePercent", DEFAULTS["movePricePercent"])
    if min_nodes and max_nodes and min_nodes > max_nodes:
        p.bad("spec.minNodes", "InvalidNodeRange",
              f"minNodes ({min_nodes}) exceeds maxNodes ({max_nodes}); raise maxNodes")
    elif min_nodes and max_nodes and replicas and not min_nodes <= replicas <= max_nodes:
        p.bad("spec.replicas", "InvalidNodeRange",
              f"the desired node count ({replicas}) must lie between minNodes ({min_nodes}) "
              f"and maxNodes ({max_nodes})")
    if (experts and f and gpus and slots and max_nodes
            and gpus * slots * max_nodes < experts * f):
        p.bad("spec.maxNodes", "InsufficientSlots",
              f"{max_nodes} nodes x {gpus} GPUs x {slots} slots = {gpus * slots * max_nodes} "
              f"expert slots cannot hold {experts} experts x {f} replicas; raise maxNodes, "
              f"gpusPerNode or slotsPerGpu, or lower minReplicas")
    _runtime(p, runtime, slots, max_nodes * gpus if max_nodes and gpus else None)
    checkpoint = _checkpoint(p, spec.get("checkpoint"))
    taints = _taints(p, spec.get("spotNoticeTaints"))
    template = p.mapping(spec, "spec", "template", "InvalidTemplate")
    check_template(p, template, gpus)
    steps = _bounded(p, spec, "steps", None) if spec.get("steps") is not None else None
    coordinator = p.mapping(spec, "spec", "coordinator", "InvalidCoordinator")
    check_coordinator(p, coordinator)
    p.raise_if_any()
    return JobSpec(
        experts=experts, layers=layers, min_nodes=min_nodes, max_nodes=max_nodes,
        replicas=replicas, gpus_per_node=gpus, slots_per_gpu=slots, min_replicas=f,
        policy=policy, rebalance_every_steps=every, rebalance_min_gain_percent=gain,
        checkpoint=checkpoint, move_price_percent=price, spot_notice_taints=taints,
        runtime=dict(runtime), template=dict(template), coordinator=dict(coordinator),
        steps=steps,
    )


def _bounded(p: SpecReader, spec: Mapping, key: str, default: int | None) -> int | None:
    low, high = LIMITS[key]
    return p.integer(spec, "spec", key, default, minimum=low, maximum=high)


def _runtime(p: SpecReader, runtime: Mapping, slots: int | None, ranks: int | None) -> None:
    """``spec.runtime`` as the workers will read it, then what it asks of every node."""
    try:
        config = RuntimeConfig.from_manifest(dict(runtime))
    except ValueError as e:
        key, message = split_error(e)
        path = f"spec.runtime.{key}" if key else "spec.runtime"
        if not p.has(path):  # experts and layers are read above
            p.bad(path, "InvalidRuntime", message)
        return
    if ranks is not None and config.data.global_batch < ranks:
        p.bad("spec.runtime.globalBatch", "InvalidRuntime",
              f"{config.data.global_batch} samples per step cannot be shared by up to "
              f"{ranks} ranks (maxNodes x gpusPerNode); raise globalBatch to at least {ranks} "
              f"or lower maxNodes")
    if slots is None:
        return
    parameters = config.model.parameters_per_rank(slots)
    need = parameters * TRAINING_BYTES_PER_PARAMETER
    if need > MAX_RANK_BYTES:
        p.bad("spec.runtime", "ModelTooLarge",
              f"each rank would hold at least {parameters:,} parameters (the dense layers "
              f"and {slots} experts per layer), {need / 2**30:,.0f} GiB of weights, gradients "
              f"and optimizer state, more than the {MAX_RANK_BYTES // 2**30} GiB of the "
              f"largest accelerator; make the model smaller (dim, ffnDim, vocab, layers) or "
              f"lower slotsPerGpu")


def _checkpoint(p: SpecReader, ck: object) -> CheckpointSpec | None:
    if ck is None:
        return None
    if not isinstance(ck, Mapping):
        p.bad("spec.checkpoint", "InvalidCheckpoint", "must be an object with path and everySteps")
        return None
    path = ck.get("path")
    # Workers on different nodes restore the same checkpoint: a shared volume or an object
    # store, in a scheme the workers can open.
    if (problem := path_problem(path)) is not None:
        p.bad("spec.checkpoint.path", "InvalidCheckpoint", problem)
    every = p.integer(ck, "spec.checkpoint", "everySteps", DEFAULTS["checkpointEverySteps"],
                      minimum=1)
    keep = p.integer(ck, "spec.checkpoint", "keep", DEFAULTS["checkpointKeep"],
                     minimum=KEEP_MIN, maximum=KEEP_MAX)
    secret = ck.get("secretName")
    if secret is not None and not (isinstance(secret, str)
                                   and kube_names.dns_1123_subdomain(secret) is None):
        p.bad("spec.checkpoint.secretName", "InvalidCheckpoint",
              f"must name a Secret in the job's namespace (a DNS subdomain), got {secret!r}")
    return CheckpointSpec(path if isinstance(path, str) else "", every, keep or KEEP_DEFAULT,
                          secret if isinstance(secret, str) else None)


def _taints(p: SpecReader, taints: object) -> tuple[str, ...]:
    if taints is None:
        return DEFAULT_SPOT_NOTICE_TAINTS
    if not isinstance(taints, list) or not all(
            isinstance(t, Mapping) and isinstance(t.get("key"), str) and t["key"] for t in taints):
        p.bad("spec.spotNoticeTaints", "InvalidSpotNoticeTaints",
              "must be a list of {key: <taint key>} entries")
        return ()
    keys = tuple(t["key"] for t in taints)
    if len(set(keys)) != len(keys):
        p.bad("spec.spotNoticeTaints", "InvalidSpotNoticeTaints", "lists a taint key twice")
    return keys
