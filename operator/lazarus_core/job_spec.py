"""The LazarusJob spec: parsed and checked once, for the operator and the local backend alike.

The CRD's schema and CEL rules reject most bad specs at admission, but the local backend has
no API server, and some rules cannot be written in the schema (resource quantities, for
example). So every rule lives here too, and each violation names the manifest field, says
what is wrong and how to fix it, and carries a CamelCase reason for a status condition.

Defaults here must equal the CRD's ``default:`` values; tests/unit/test_job_spec.py checks
that they do.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from .checkpoint_location import KEEP_DEFAULT, KEEP_MAX, KEEP_MIN, path_problem
from .plan import POLICIES

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
    "checkpointEverySteps": 50,
    "checkpointKeep": KEEP_DEFAULT,
}

_GPU_RESOURCE = "nvidia.com/gpu"
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass(frozen=True)
class Violation:
    field: str  # manifest path, e.g. "spec.maxNodes"
    reason: str  # CamelCase, for a status condition
    message: str  # names the field and the fix

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class SpecError(ValueError):
    """A spec that can never run; ``violations`` lists every problem, each naming its field."""

    def __init__(self, violations: list[Violation]):
        self.violations = violations
        super().__init__("; ".join(str(v) for v in violations))

    @property
    def reason(self) -> str:
        return self.violations[0].reason


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
    # Rebalance only if the measured max/mean load imbalance improves by this many percent.
    rebalance_min_gain_percent: int
    checkpoint: CheckpointSpec | None
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
    """(name, spec) of a whole LazarusJob document, as `kubectl apply` or `lazarus run` read it."""
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
    if not isinstance(name, str) or not _DNS_LABEL.match(name) or len(name) > 40:
        problems.append(Violation(
            "metadata.name", "InvalidName",
            "must be a DNS label of at most 40 characters (lower case letters, digits, '-'), "
            "because pod and ConfigMap names are derived from it"))
    try:
        spec = parse_spec(doc.get("spec"))
    except SpecError as e:
        problems.extend(e.violations)
    if problems:
        raise SpecError(problems)
    return name, spec


def parse_spec(spec: object) -> JobSpec:
    """A checked JobSpec from a manifest's ``spec``, or SpecError listing every violation."""
    p = _Reader()
    if not isinstance(spec, Mapping):
        raise SpecError([Violation("spec", "InvalidSpec", "must be an object")])
    runtime = spec.get("runtime", {})
    if not isinstance(runtime, Mapping):
        p.bad("spec.runtime", "InvalidRuntime", "must be an object of runtime arguments")
        runtime = {}
    experts = p.integer(runtime, "spec.runtime", "experts", None, minimum=1)
    layers = p.integer(runtime, "spec.runtime", "layers", None, minimum=1)
    top_k = p.integer(runtime, "spec.runtime", "topK", 1, minimum=1)
    if experts and top_k and top_k > experts:
        p.bad("spec.runtime.topK", "InvalidRuntime",
              f"{top_k} exceeds the number of experts ({experts}); lower topK")
    min_nodes = p.integer(spec, "spec", "minNodes", None, minimum=1)
    max_nodes = p.integer(spec, "spec", "maxNodes", None, minimum=1)
    replicas = p.integer(spec, "spec", "replicas", max_nodes, minimum=1)
    gpus = p.integer(spec, "spec", "gpusPerNode", DEFAULTS["gpusPerNode"], minimum=1)
    slots = p.integer(spec, "spec", "slotsPerGpu", DEFAULTS["slotsPerGpu"], minimum=1)
    f = p.integer(spec, "spec", "minReplicas", DEFAULTS["minReplicas"], minimum=1)
    policy = spec.get("placement", DEFAULTS["placement"])
    if policy not in POLICIES:
        p.bad("spec.placement", "InvalidPlacement",
              f"must be one of {', '.join(POLICIES)}, got {policy!r}")
    every = p.integer(spec, "spec", "rebalanceEverySteps", DEFAULTS["rebalanceEverySteps"],
                      minimum=0)
    gain = p.integer(spec, "spec", "rebalanceMinGainPercent",
                     DEFAULTS["rebalanceMinGainPercent"], minimum=0)
    if min_nodes and max_nodes and min_nodes > max_nodes:
        p.bad("spec.minNodes", "InvalidNodeRange",
              f"minNodes ({min_nodes}) exceeds maxNodes ({max_nodes}); raise maxNodes")
    if min_nodes and max_nodes and replicas and not min_nodes <= replicas <= max_nodes:
        p.bad("spec.replicas", "InvalidNodeRange",
              f"the desired node count ({replicas}) must lie between minNodes ({min_nodes}) "
              f"and maxNodes ({max_nodes})")
    if (experts and f and gpus and slots and max_nodes
            and gpus * slots * max_nodes < experts * f):
        p.bad("spec.maxNodes", "InsufficientSlots",
              f"{max_nodes} nodes x {gpus} GPUs x {slots} slots = {gpus * slots * max_nodes} "
              f"expert slots cannot hold {experts} experts x {f} replicas; raise maxNodes, "
              f"gpusPerNode or slotsPerGpu, or lower minReplicas")
    checkpoint = _checkpoint(p, spec.get("checkpoint"))
    taints = _taints(p, spec.get("spotNoticeTaints"))
    template = spec.get("template", {})
    if not isinstance(template, Mapping):
        p.bad("spec.template", "InvalidTemplate", "must be an object")
        template = {}
    elif gpus:
        _check_gpu_request(p, template, gpus)
    steps = (p.integer(spec, "spec", "steps", None, minimum=1)
             if spec.get("steps") is not None else None)
    coordinator = spec.get("coordinator", {})
    if not isinstance(coordinator, Mapping):
        p.bad("spec.coordinator", "InvalidCoordinator", "must be an object")
        coordinator = {}
    p.raise_if_any()
    return JobSpec(
        experts=experts, layers=layers, min_nodes=min_nodes, max_nodes=max_nodes,
        replicas=replicas, gpus_per_node=gpus, slots_per_gpu=slots, min_replicas=f,
        policy=policy, rebalance_every_steps=every, rebalance_min_gain_percent=gain,
        checkpoint=checkpoint, spot_notice_taints=taints, runtime=dict(runtime),
        template=dict(template), coordinator=dict(coordinator), steps=steps,
    )


def _checkpoint(p: "_Reader", ck: object) -> CheckpointSpec | None:
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
                     minimum=KEEP_MIN)
    if keep is not None and keep > KEEP_MAX:
        p.bad("spec.checkpoint.keep", "InvalidField", f"must be <= {KEEP_MAX}, got {keep}")
    secret = ck.get("secretName")
    if secret is not None and not (isinstance(secret, str) and len(secret) <= 253
                                   and _DNS_SUBDOMAIN.match(secret)):
        p.bad("spec.checkpoint.secretName", "InvalidCheckpoint",
              f"must name a Secret in the job's namespace (a DNS subdomain), got {secret!r}")
    return CheckpointSpec(path if isinstance(path, str) else "", every, keep or KEEP_DEFAULT,
                          secret if isinstance(secret, str) else None)


def _taints(p: "_Reader", taints: object) -> tuple[str, ...]:
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


def _check_gpu_request(p: "_Reader", template: Mapping, gpus: int) -> None:
    """The pod's nvidia.com/gpu request must be gpusPerNode: the plan gives each GPU a rank."""
    resources = template.get("resources") or {}
    for kind in ("limits", "requests"):
        value = (resources.get(kind) or {}).get(_GPU_RESOURCE) if isinstance(resources, Mapping) else None
        if value is None:
            continue
        if str(value) != str(gpus):
            p.bad(f"spec.template.resources.{kind}[{_GPU_RESOURCE}]", "GpuRequestMismatch",
                  f"requests {value} GPUs but gpusPerNode is {gpus}; make them equal "
                  f"(each GPU hosts one worker rank), or leave it out for CPU workers")


class _Reader:
    """Collects violations so a user sees every problem of a spec at once."""

    def __init__(self):
        self.violations: list[Violation] = []

    def bad(self, path: str, reason: str, message: str) -> None:
        self.violations.append(Violation(path, reason, message))

    def integer(self, d: Mapping, where: str, key: str, default: int | None, *,
                minimum: int) -> int | None:
        v = d.get(key, default)
        path = f"{where}.{key}"
        if v is None:
            self.bad(path, "MissingField", "is required")
            return None
        if not isinstance(v, int) or isinstance(v, bool):
            self.bad(path, "InvalidField", f"must be an integer, got {v!r}")
            return None
        if v < minimum:
            self.bad(path, "InvalidField", f"must be >= {minimum}, got {v}")
            return None
        return v

    def raise_if_any(self) -> None:
        if self.violations:
            raise SpecError(self.violations)
