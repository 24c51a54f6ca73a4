"""The placement solver: from nodes and expert loads to a validated plan, and re-plans."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .allocation import allocate_replicas
from .migration import Migration, map_devices, map_nodes_optimal, plan_transfers
from .mro import mro
from .placement import Placement, compact, spread
from .plan import POLICIES, LayerPlan, Plan, PlanNode, validate
from .recovery import recovery_table
from .topology import NodeSpec, check_nodes, failure_domain_order

DEFAULT_MAX_FAILURES = 5


def place(policy: str, layers: Sequence[Sequence[int]], slots: Sequence[int]) -> list[Placement]:
    if policy == "mro":
        return mro(layers, slots)
    if policy == "spread":
        return [spread(r, slots) for r in layers]
    if policy == "compact":
        return [compact(r, slots) for r in layers]
    raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {policy!r}")


def allocate_layers(loads: Sequence[Sequence[float]] | None, layers: int, experts: int,
                    total_slots: int, min_replicas: int) -> list[list[int]]:
    if loads is None:
        loads = [[1.0] * experts] * layers
    if len(loads) != layers or any(len(l) != experts for l in loads):
        raise ValueError(f"loads: need {layers} layers x {experts} experts of load")
    return [allocate_replicas(l, total_slots, min_replicas) for l in loads]


def plan_job(nodes: Sequence[NodeSpec], experts: int, layers: int, min_replicas: int,
             policy: str = "mro", loads: Sequence[Sequence[float]] | None = None,
             generation: int = 1, reason: str = "Initial",
             max_failures: int = DEFAULT_MAX_FAILURES) -> Plan:
    """A complete plan: replicas per layer from the loads, placed by ``policy``."""
    ordered, replicas, placements = layout(nodes, experts, layers, min_replicas, policy, loads)
    return build_plan(ordered, replicas, placements, experts, min_replicas, policy,
                      generation, reason, max_failures)


def layout(nodes: Sequence[NodeSpec], experts: int, layers: int, min_replicas: int,
           policy: str, loads: Sequence[Sequence[float]] | None):
    """Node order, replicas per layer and placements: a plan before it has node identities."""
    if experts < 1:
        raise ValueError(f"experts: must be >= 1, got {experts}")
    if layers < 1:
        raise ValueError(f"layers: must be >= 1, got {layers}")
    check_nodes(list(nodes))
    ordered = failure_domain_order(list(nodes))
    slots = [n.slots for n in ordered]
    replicas = allocate_layers(loads, layers, experts, sum(slots), min_replicas)
    return ordered, replicas, place(policy, replicas, slots)


def build_plan(ordered: Sequence[NodeSpec], replicas, placements, experts, min_replicas,
               policy, generation, reason, max_failures,
               devices: Sequence[Sequence[int]] | None = None) -> Plan:
    """``devices``: per node, which of its GPUs run its ranks in order (default: its usable
    GPUs in index order)."""
    plan_nodes, rank = [], 0
    for i, n in enumerate(ordered):
        plan_nodes.append(PlanNode(name=n.name, ranks=tuple(range(rank, rank + n.gpus)),
                                   slots_per_rank=n.slots_per_gpu, zone=n.zone,
                                   devices=tuple(devices[i] if devices else n.devices)))
        rank += n.gpus
    return validate(Plan(
        generation=generation,
        experts=experts,
        min_replicas=min_replicas,
        policy=policy,
        reason=reason,
        nodes=tuple(plan_nodes),
        layers=tuple(LayerPlan(tuple(r), tuple(tuple(s) for s in p))
                     for r, p in zip(replicas, placements)),
        recovery=recovery_table(placements, max_failures) if max_failures else {},
    ))


@dataclass(frozen=True)
class Replan:
    plan: Plan
    migration: Migration


def replan(old: Plan, nodes: Sequence[NodeSpec], reason: str, sources: set[str],
           loads: Sequence[Sequence[float]] | None = None,
           max_failures: int = DEFAULT_MAX_FAILURES) -> Replan:
    """The next generation for ``nodes``, mapped onto them to move as little as possible.

    ``sources`` are the old plan's nodes that can still send expert state.
    """
    positions, replicas, placements = layout(nodes, old.experts, len(old.layers),
                                             old.min_replicas, old.policy, loads)
    mapping = map_nodes_optimal(old, list(nodes), positions, placements)
    # Position q keeps its slots and zone; it is now played by nodes[mapping[q]], each of
    # its ranks by the GPU of that node that holds most of what the rank needs.
    ordered = [nodes[i] for i in mapping]
    devices = [map_devices(old, node, [p[q] for p in placements])
               for q, node in enumerate(ordered)]
    plan = build_plan(ordered, replicas, placements, old.experts, old.min_replicas,
                      old.policy, old.generation + 1, reason, max_failures, devices)
    return Replan(plan, plan_transfers(old, plan, sources))
