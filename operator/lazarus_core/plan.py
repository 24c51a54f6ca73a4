"""The placement plan: the one contract between the controller and the workers.

A plan generation says, for every MoE layer, how many replicas each expert has and which
slots of which node hold them. Workers consume exactly this object (as JSON); the operator
publishes it and the local backend hands it to its processes.

Two encodings, one schema: ``to_json`` writes the plan as a JSON object, and
``to_compact_json`` writes that same JSON zlib-compressed and base64-encoded inside a small
JSON envelope ({"version", "encoding": "zlib+base64", "data"}), because a plan for thousands
of GPUs (3.7 MiB of JSON at 4,096) must fit one API object (1 MiB). ``from_json`` reads both.

Node order is rank order: node i owns the ranks in ``nodes[i].ranks`` and its slots are
``placement[i]``. Slot s of a node belongs to its rank ``ranks[s // slots_per_rank]``, which
the node's GPU ``devices[s // slots_per_rank]`` runs: one rank process per GPU, named by
``member_name(node, device)``. A node's devices are 0..n-1 until it loses a GPU.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain
from typing import NamedTuple

import numpy as np

SCHEMA_VERSION = "lazarus.dev/plan/v1"
COMPACT_ENCODING = "zlib+base64"
# zlib's default: level 9 takes five times as long for 1% less at 4,096 GPUs.
COMPRESSION_LEVEL = 6
# Placement policies a plan can be made with (spec.placement).
POLICIES = ("mro", "spread", "compact")

# One expert of one MoE layer: (layer, expert id).
ExpertKey = tuple[int, int]


class PlanError(ValueError):
    """A plan that violates the schema; ``violations`` lists every problem with its field."""

    def __init__(self, violations: list[str]):
        self.violations = violations
        super().__init__("; ".join(violations))


@dataclass(frozen=True)
class PlanNode:
    """One failure domain (a machine): its name, its zone and the worker ranks it hosts."""

    name: str
    ranks: tuple[int, ...]
    slots_per_rank: int
    zone: str = ""
    # The node's GPUs (its agent's local ranks) that run ``ranks``, in the same order; by
    # default 0..len(ranks)-1.
    devices: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.devices:
            object.__setattr__(self, "devices", tuple(range(len(self.ranks))))

    @property
    def slots(self) -> int:
        return len(self.ranks) * self.slots_per_rank

    def members(self) -> tuple[str, ...]:
        """The names of the rank processes that run this node's ranks, in rank order."""
        return tuple(member_name(self.name, d) for d in self.devices)


def member_name(node: str, device: int) -> str:
    """The name of one rank process: its node, and the GPU of the node it runs on (its local
    rank). Node names never hold a "/" (Kubernetes names are DNS subdomains)."""
    return f"{node}/{device}"


def member_node(member: str) -> str:
    """The node a rank process (``member_name``) runs on."""
    return member.rsplit("/", 1)[0]


def member_device(member: str) -> int:
    """The GPU of its node a rank process (``member_name``) runs on."""
    node, _, device = member.rpartition("/")
    if not node or not device.isdigit():
        raise ValueError(f"{member!r} names no rank process (NODE/GPU)")
    return int(device)


class LayerPlan:
    """Replica counts per expert (expert-id order) and the expert id in each node's slots.

    Immutable, compared and hashed by (``replicas``, ``placement``) as a frozen dataclass
    would be. ``placement`` is a tuple of slot tuples per node; a layer the solver made from
    one array of slots (``from_slots``) keeps the array and makes the tuples on first use:
    a plan at 1,024 GPUs holds 240,000 slots, and a plan that is built, validated,
    compared by counts and published (``Plan.to_dict`` reads the array) never needs them.
    """

    def __init__(self, replicas: tuple[int, ...], placement: tuple[tuple[int, ...], ...]):
        self.__dict__.update(replicas=replicas, placement=placement)

    @classmethod
    def from_slots(cls, replicas: Sequence[Sequence[int]], slots: np.ndarray,
                   sizes: Sequence[int]) -> tuple["LayerPlan", ...]:
        """Layers from every node's slots as one [layer, slot] array (node order, ``sizes``
        slots each), as the solver fills them. Each keeps its row as ``flat`` and its
        counts, computed for all layers at once: a million slots converted back from
        tuples, or counted a layer at a time, cost a re-plan at 1,024 GPUs a tenth of its
        time each."""
        slots = np.asarray(slots, dtype=np.int64)
        batch = _Counts(slots, sizes, len(replicas[0]) if len(replicas) else 0)
        sizes = tuple(sizes)
        layers = []
        for li, (r, row) in enumerate(zip(replicas, slots)):
            layer = cls.__new__(cls)
            # cached_property's slots: ``placement`` is made from the row when first read
            layer.__dict__.update(replicas=tuple(r), flat=row, sizes=sizes, _batch=(batch, li))
            layers.append(layer)
        return tuple(layers)

    @cached_property
    def placement(self) -> tuple[tuple[int, ...], ...]:
        """Every node's slots, a tuple per node (made once, from ``flat``)."""
        return tuple(map(tuple, split_slots(self.flat, self.sizes)))

    @cached_property
    def sizes(self) -> tuple[int, ...]:
        """How many slots each node has."""
        return tuple(len(p) for p in self.placement)

    @cached_property
    def flat(self) -> np.ndarray:
        """Every node's slots in node order, as one array (computed once)."""
        return _flat(self.placement)

    @cached_property
    def counts(self) -> np.ndarray:
        """[node, expert]: replicas of each expert on each node (computed once; for every
        layer at once, for layers made together by ``from_slots``)."""
        if "_batch" in self.__dict__:
            batch, li = self.__dict__["_batch"]
            return batch.counts[li]
        return _counts(self.flat, self.sizes, len(self.replicas))

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name):
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")

    def __eq__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        if self.replicas != other.replicas:
            return False
        if "placement" not in self.__dict__ and "placement" not in other.__dict__:
            return self.sizes == other.sizes and np.array_equal(self.flat, other.flat)
        return self.placement == other.placement

    def __hash__(self):
        return hash((self.replicas, self.placement))

    def __repr__(self):
        return f"LayerPlan(replicas={self.replicas!r}, placement={self.placement!r})"


def split_slots(slots: np.ndarray, sizes: Sequence[int]) -> list[list[int]]:
    """Every node's slots in node order, one array, as one list per node (``sizes``)."""
    values = slots.tolist()
    if len(set(sizes)) == 1:
        width = sizes[0]
        return [values[i:i + width] for i in range(0, len(values), width)]
    bounds = np.concatenate(([0], np.cumsum(sizes))).tolist()
    return [values[a:b] for a, b in zip(bounds, bounds[1:])]


def _flat(placement: Sequence[Sequence[int]]) -> np.ndarray:
    sizes = [len(p) for p in placement]
    if len(set(sizes)) == 1:  # every node alike: one array conversion, no Python loop
        return np.array(placement, dtype=np.int64).ravel()
    return np.fromiter(chain.from_iterable(placement), dtype=np.int64, count=sum(sizes))


def replica_counts(placement: Sequence[Sequence[int]], num_experts: int | None = None
                   ) -> np.ndarray:
    """[node, expert]: how many replicas of the expert the node holds (as many experts as
    the highest id present needs, when ``num_experts`` is not given)."""
    return _counts(_flat(placement), [len(p) for p in placement], num_experts)


class _Counts:
    """``LayerPlan.counts`` of layers made together, computed at once when first needed."""

    def __init__(self, slots: np.ndarray, sizes: Sequence[int], experts: int):
        self.slots, self.sizes, self.experts = slots, sizes, experts

    @cached_property
    def counts(self) -> np.ndarray:
        """[layer, node, expert]."""
        num_layers, num_nodes = len(self.slots), len(self.sizes)
        rows = np.repeat(np.arange(num_nodes), self.sizes)
        offsets = (np.arange(num_layers)[:, None] * num_nodes + rows[None, :]) * self.experts
        # int16: a node holds at most its slots of one expert (solver.LIMITS: 1,024), and
        # re-plans gather and compare this cube several times (a quarter of int64's bytes).
        # Counted straight into int16: most cells are empty, and ``np.bincount`` fills an
        # int64 cell for each before the cast (a re-plan's new plan at 1,024 GPUs: 6 ms
        # against 2).
        cube = np.zeros(num_layers * num_nodes * self.experts, dtype=np.int16)
        np.add.at(cube, (offsets + self.slots).ravel(), np.int16(1))
        return cube.reshape(num_layers, num_nodes, self.experts)


def _counts(flat: np.ndarray, sizes: Sequence[int], num_experts: int | None) -> np.ndarray:
    if num_experts is None:
        num_experts = int(flat.max()) + 1 if len(flat) else 0
    return _Counts(np.asarray(flat, dtype=np.int64)[None, :], sizes, num_experts).counts[0]


def count_cube(layers: Sequence[LayerPlan]) -> np.ndarray:
    """[layer, node, expert]: every layer's ``counts`` as one array (the one they are views
    of, where the layers were made together by ``LayerPlan.from_slots``)."""
    batch = _whole_batch(layers)
    return batch.counts if batch is not None else np.stack([layer.counts for layer in layers])


def _whole_batch(layers: Sequence[LayerPlan]) -> _Counts | None:
    """The batch ``LayerPlan.from_slots`` made ``layers`` in, where they are all of it, in
    order; else None."""
    batches = [layer.__dict__.get("_batch") for layer in layers]
    if batches and all(b is not None and b[0] is batches[0][0] and b[1] == li
                       for li, b in enumerate(batches)) \
            and len(batches[0][0].slots) == len(layers):
        return batches[0][0]
    return None


@dataclass(frozen=True)
class Plan:
    generation: int
    experts: int
    min_replicas: int
    policy: str
    nodes: tuple[PlanNode, ...]
    layers: tuple[LayerPlan, ...]
    # Why this generation exists (Initial, NodeLost, NodeJoined, Rebalance, SpotNotice, ...).
    reason: str = "Initial"
    # Model-level recovery probability for k failed nodes, k = 1..K, keyed by str(k).
    recovery: dict[str, float] = field(default_factory=dict)
    version: str = SCHEMA_VERSION

    @cached_property
    def slot_matrix(self) -> np.ndarray:
        """[layer, slot]: every layer's ``flat`` slots, stacked (computed once; the array
        they are rows of, where the layers were made together by ``LayerPlan.from_slots``)."""
        batch = _whole_batch(self.layers)
        return batch.slots if batch is not None else np.stack([layer.flat for layer in self.layers])

    @cached_property
    def count_cube(self) -> np.ndarray:
        """[layer, node, expert]: every layer's ``counts`` as one array (``count_cube``)."""
        return count_cube(self.layers)

    @cached_property
    def slot_offsets(self) -> tuple[int, ...]:
        """Where each node's slots start in ``slot_matrix``, and where the last ends."""
        return tuple(np.concatenate(([0], np.cumsum([n.slots for n in self.nodes]))).tolist())

    @property
    def world_size(self) -> int:
        return sum(len(n.ranks) for n in self.nodes)

    def rank_experts(self, layer: int, rank: int) -> tuple[int, ...]:
        """Expert ids held by ``rank`` in ``layer``, one entry per slot (repeats allowed)."""
        for node, slots in zip(self.nodes, self.layers[layer].placement):
            if rank in node.ranks:
                i = node.ranks.index(rank)
                c = node.slots_per_rank
                return slots[i * c:(i + 1) * c]
        raise KeyError(f"rank {rank} is not in plan generation {self.generation}")

    def members(self) -> dict[str, int]:
        """Every rank process of the plan (``member_name``) with its rank, in rank order."""
        out = {m: r for n in self.nodes for m, r in zip(n.members(), n.ranks)}
        return dict(sorted(out.items(), key=lambda item: item[1]))

    def by_rank(self) -> "Plan":
        """The same placement seen one rank at a time: a node per rank process, named by
        ``member_name``, holding that rank's slots. Migration planning runs on this view,
        so a replica that a node holds on one GPU but needs on another also moves."""
        nodes, layers = [], [[] for _ in self.layers]
        for i, node in enumerate(self.nodes):
            c = node.slots_per_rank
            for j, (member, rank) in enumerate(zip(node.members(), node.ranks)):
                nodes.append(PlanNode(member, (rank,), c, node.zone))
                for li, layer in enumerate(self.layers):
                    layers[li].append(layer.placement[i][j * c:(j + 1) * c])
        order = sorted(range(len(nodes)), key=lambda k: nodes[k].ranks[0])
        return dataclasses.replace(
            self, nodes=tuple(nodes[k] for k in order),
            layers=tuple(LayerPlan(l.replicas, tuple(placed[k] for k in order))
                         for l, placed in zip(self.layers, layers)))

    def node_index(self, name: str) -> int:
        try:
            return self._node_indexes[name]
        except KeyError:
            raise KeyError(f"node {name!r} is not in plan generation {self.generation}"
                           ) from None

    @cached_property
    def _node_indexes(self) -> dict[str, int]:
        return {node.name: i for i, node in enumerate(self.nodes)}

    # --- serialisation -------------------------------------------------------------------

    def to_dict(self) -> dict:
        # Built by hand: dataclasses.asdict deep-copies a million slots one by one.
        return {
            "version": self.version,
            "generation": self.generation,
            "experts": self.experts,
            "min_replicas": self.min_replicas,
            "policy": self.policy,
            "reason": self.reason,
            "recovery": dict(self.recovery),
            "nodes": [{"name": n.name, "ranks": list(n.ranks),
                       "slots_per_rank": n.slots_per_rank, "zone": n.zone,
                       "devices": list(n.devices)} for n in self.nodes],
            "layers": [{"replicas": list(l.replicas), "placement": split_slots(l.flat, l.sizes)}
                       for l in self.layers],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def to_compact_json(self) -> str:
        """The same JSON, compressed, in an envelope (see the module docstring)."""
        data = base64.b64encode(zlib.compress(self.to_json().encode(), COMPRESSION_LEVEL))
        return json.dumps({"version": self.version, "encoding": COMPACT_ENCODING,
                           "data": data.decode("ascii")}, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        violations = _shape_violations(d)
        if violations:
            raise PlanError(violations)
        plan = cls(
            version=d["version"],
            generation=d["generation"],
            experts=d["experts"],
            min_replicas=d["min_replicas"],
            policy=d["policy"],
            reason=d.get("reason", "Initial"),
            recovery={str(k): float(v) for k, v in d.get("recovery", {}).items()},
            nodes=tuple(
                PlanNode(
                    name=n["name"],
                    ranks=tuple(n["ranks"]),
                    slots_per_rank=n["slots_per_rank"],
                    zone=n.get("zone", ""),
                    devices=tuple(n.get("devices", ())),
                )
                for n in d["nodes"]
            ),
            layers=tuple(
                LayerPlan(
                    replicas=tuple(l["replicas"]),
                    placement=tuple(tuple(s) for s in l["placement"]),
                )
                for l in d["layers"]
            ),
        )
        validate(plan)
        return plan

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """A plan from either encoding (``to_json`` or ``to_compact_json``)."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError([f"plan: not valid JSON ({e})"]) from None
        if isinstance(d, dict) and "encoding" in d:
            d = _unpack(d)
        return cls.from_dict(d)


class Transfer(NamedTuple):
    """One expert replica's state (weights and optimizer moments) sent from a node that
    holds it to a node of the new plan that lacks it. (A named tuple: a re-plan at 1,024
    GPUs makes thousands, and a frozen dataclass costs three times as much to build.)"""

    layer: int
    expert: int
    source: str
    destination: str


def _unpack(envelope: dict) -> dict:
    if envelope.get("encoding") != COMPACT_ENCODING:
        raise PlanError([f"encoding: must be {COMPACT_ENCODING!r}, got "
                         f"{envelope.get('encoding')!r}"])
    if not isinstance(envelope.get("data"), str):
        raise PlanError(["data: must be a string (the compressed plan, base64)"])
    try:
        text = zlib.decompress(base64.b64decode(envelope["data"], validate=True))
        d = json.loads(text)
    except (ValueError, zlib.error) as e:  # binascii.Error and JSONDecodeError included
        raise PlanError([f"data: not a {COMPACT_ENCODING} plan ({e})"]) from None
    if isinstance(d, dict) and d.get("version") != envelope.get("version"):
        raise PlanError([f"version: the envelope says {envelope.get('version')!r}, the plan "
                         f"{d.get('version')!r}"])
    return d


def _shape_violations(d) -> list[str]:
    """Type checks that must pass before the dataclasses can be built at all."""
    if not isinstance(d, dict):
        return ["plan: must be a JSON object"]
    v = []
    if d.get("version") != SCHEMA_VERSION:
        v.append(f"version: must be {SCHEMA_VERSION!r}, got {d.get('version')!r}")
    for key in ("generation", "experts", "min_replicas"):
        if not isinstance(d.get(key), int) or isinstance(d.get(key), bool):
            v.append(f"{key}: must be an integer")
    if not isinstance(d.get("policy"), str):
        v.append("policy: must be a string")
    nodes = d.get("nodes")
    if not isinstance(nodes, list):
        v.append("nodes: must be a list")
    else:
        for i, n in enumerate(nodes):
            if not isinstance(n, dict):
                v.append(f"nodes[{i}]: must be an object")
                continue
            if not isinstance(n.get("name"), str):
                v.append(f"nodes[{i}].name: must be a string")
            if not isinstance(n.get("ranks"), list) or not all(
                isinstance(r, int) for r in n.get("ranks", [])
            ):
                v.append(f"nodes[{i}].ranks: must be a list of integers")
            if not isinstance(n.get("slots_per_rank"), int):
                v.append(f"nodes[{i}].slots_per_rank: must be an integer")
            if not isinstance(n.get("devices", []), list) or not all(
                isinstance(d, int) for d in n.get("devices", [])
            ):
                v.append(f"nodes[{i}].devices: must be a list of integers")
    layers = d.get("layers")
    if not isinstance(layers, list):
        v.append("layers: must be a list")
    else:
        for i, l in enumerate(layers):
            if not isinstance(l, dict):
                v.append(f"layers[{i}]: must be an object")
                continue
            if not isinstance(l.get("replicas"), list):
                v.append(f"layers[{i}].replicas: must be a list")
            p = l.get("placement")
            if not isinstance(p, list) or not all(isinstance(s, list) for s in p):
                v.append(f"layers[{i}].placement: must be a list of lists")
    return v


def violations(plan: Plan) -> list[str]:
    """Every way ``plan`` breaks the schema's invariants, each naming its field."""
    v = []
    if plan.generation < 1:
        v.append("generation: must be >= 1")
    if plan.experts < 1:
        v.append("experts: must be >= 1")
    if plan.min_replicas < 1:
        v.append("min_replicas: must be >= 1")
    if not plan.nodes:
        v.append("nodes: must not be empty")
    names = [n.name for n in plan.nodes]
    if len(set(names)) != len(names):
        v.append("nodes: node names must be unique")
    ranks = [r for n in plan.nodes for r in n.ranks]
    if sorted(ranks) != list(range(len(ranks))):
        v.append(f"nodes[].ranks: ranks must be exactly 0..{len(ranks) - 1}, each once")
    for i, n in enumerate(plan.nodes):
        if not n.ranks:
            v.append(f"nodes[{i}].ranks: a node must host at least one rank")
        if n.slots_per_rank < 1:
            v.append(f"nodes[{i}].slots_per_rank: must be >= 1")
        if len(n.devices) != len(n.ranks) or len(set(n.devices)) != len(n.devices) or (
                n.devices and min(n.devices) < 0):
            v.append(f"nodes[{i}].devices: needs one distinct GPU index >= 0 per rank "
                     f"({len(n.ranks)})")
        if "/" in n.name:
            v.append(f"nodes[{i}].name: must not contain '/'")
    if not plan.layers:
        v.append("layers: must not be empty")
    node_slots = np.array([n.slots for n in plan.nodes], dtype=np.int64)
    for li, layer in enumerate([] if _layers_sound(plan, node_slots) else plan.layers):
        where = f"layers[{li}]"
        if len(layer.replicas) != plan.experts:
            v.append(f"{where}.replicas: needs one count per expert ({plan.experts})")
        if len(layer.sizes) != len(plan.nodes):
            v.append(f"{where}.placement: needs one slot list per node ({len(plan.nodes)})")
            continue
        v.extend(_layer_violations(where, layer, plan, node_slots))
    for k, p in plan.recovery.items():
        if not (str(k).isdigit() and 0.0 <= p <= 1.0):
            v.append(f"recovery[{k}]: must map a failure count to a probability in [0, 1]")
    return v


def _layers_sound(plan: Plan, node_slots: np.ndarray) -> bool:
    """Whether every layer's slot counts, expert ids and replica counts hold, checked for
    all layers at once (a re-plan's plan at 1,024 GPUs: 2.4 ms, against 4.6 layer by layer);
    ``_layer_violations`` names what is wrong where they do not."""
    layers = plan.layers
    if not layers:
        return True
    if any(len(layer.replicas) != plan.experts or len(layer.sizes) != len(node_slots)
           for layer in layers):
        return False
    if (np.array([layer.sizes for layer in layers], dtype=np.int64) != node_slots).any():
        return False
    slots = plan.slot_matrix  # every layer as long, its sizes being the nodes' slots
    if slots.size and not (0 <= slots.min() and slots.max() < plan.experts):
        return False
    want = np.array([layer.replicas for layer in layers], dtype=np.int64)
    return bool((want >= 1).all() and (want.ravel() == np.bincount(
        (slots + np.arange(len(layers))[:, None] * plan.experts).ravel(),
        minlength=want.size)).all())


def _layer_violations(where: str, layer: LayerPlan, plan: Plan, node_slots: np.ndarray
                      ) -> list[str]:
    """One layer's slot counts, expert ids and replica counts, checked as arrays (a large
    plan has a million slots); the loops below only run to name what is wrong."""
    v = []
    sizes = np.array(layer.sizes, dtype=np.int64)
    for ni in np.flatnonzero(sizes != node_slots).tolist():
        node = plan.nodes[ni]
        v.append(f"{where}.placement[{ni}]: node {node.name} has {node.slots} slots, "
                 f"plan fills {sizes[ni]}")
    flat = layer.flat
    if len(flat) and not (0 <= flat.min() and flat.max() < plan.experts):
        for ni, slots in enumerate(layer.placement):
            if slots and not (0 <= min(slots) and max(slots) < plan.experts):
                v.append(f"{where}.placement[{ni}]: expert ids must be in 0..{plan.experts - 1}")
        flat = flat[(flat >= 0) & (flat < plan.experts)]
    if len(layer.replicas) == plan.experts:
        want = np.array(layer.replicas, dtype=np.int64)
        got = np.bincount(flat, minlength=plan.experts)
        for e in np.flatnonzero((want != got) | (want < 1)).tolist():
            if want[e] != got[e]:
                v.append(f"{where}.replicas[{e}]: says {want[e]}, placement holds {got[e]}")
            if want[e] < 1:
                v.append(f"{where}.replicas[{e}]: every expert needs at least one replica")
    return v


def validate(plan: Plan) -> Plan:
    problems = violations(plan)
    if problems:
        raise PlanError(problems)
    return plan
