"""`lazarus plan`: replica counts, placement and recovery probability for a configuration."""
from __future__ import annotations

import json

from lazarus_core.loads import parse_loads
from lazarus_core.plan import POLICIES, Plan, split_slots
from lazarus_core.recovery import cube_presence, zone_survival
from lazarus_core.solver import check_size, plan_job
from lazarus_core.topology import NodeSpec


def register(sub) -> None:
    p = sub.add_parser("plan", help="place experts and report recovery probability")
    p.add_argument("--nodes", type=int, required=True, help="failure domains N")
    p.add_argument("--slots", type=int, required=True, help="expert slots per node c")
    p.add_argument("--experts", type=int, required=True, help="experts per MoE layer E")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--min-replicas", type=int, default=2, help="fault-tolerance threshold f")
    p.add_argument("--policy", choices=POLICIES, default="mro",
                   help="policy for --json output (the table shows all three)")
    p.add_argument("--loads", default="zipf:0",
                   help="zipf:S (expert i gets load 1/(i+1)^S) or a JSON file: a list of "
                        "per-expert loads, or one such list per layer")
    p.add_argument("--failures", type=int, default=None,
                   help="report k = 1..K failed nodes (default: up to 5)")
    p.add_argument("--zones", default="1",
                   help="a zone count (nodes dealt round-robin) or one zone name per node, "
                        "comma-separated")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    for name in ("nodes", "slots", "experts", "layers", "min_replicas"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    check_size(args.nodes, args.slots, args.experts, args.layers,
               {f: f"--{f}" for f in ("nodes", "slots", "experts", "layers")})
    if args.failures is None:
        args.failures = min(5, args.nodes)
    if not 0 <= args.failures <= args.nodes:
        raise ValueError(f"--failures: must be in 0..{args.nodes}, got {args.failures}")
    nodes = [NodeSpec(f"node-{i}", 1, args.slots, zone=z)
             for i, z in enumerate(parse_zones(args.zones, args.nodes))]
    loads = parse_loads(args.loads, args.experts, args.layers)

    def plan(policy: str) -> Plan:
        return plan_job(nodes, args.experts, args.layers, args.min_replicas, policy,
                        loads=loads, max_failures=args.failures)

    if args.json:  # one policy: do not pay for the other two
        print(json.dumps(plan_summary(plan(args.policy)), sort_keys=True))
    else:
        print(render_table({policy: plan(policy) for policy in POLICIES}, args.failures))
    return 0


def parse_zones(spec: str, num_nodes: int) -> list[str]:
    if spec.isdigit():
        count = int(spec)
        if not 1 <= count <= num_nodes:
            raise ValueError(f"--zones: must be 1..{num_nodes} (every zone needs a node), "
                             f"got {count}")
        return [f"zone-{i % count}" for i in range(num_nodes)]
    names = [z.strip() for z in spec.split(",")]
    if len(names) != num_nodes:
        raise ValueError(f"--zones: give a count or exactly {num_nodes} zone names, "
                         f"got {len(names)}")
    if not all(names):
        raise ValueError(f"--zones: zone name {names.index('') + 1} is empty")
    return names


def plan_summary(plan: Plan) -> dict:
    node_index = {n.name: i for i, n in enumerate(plan.nodes)}
    # Lists straight from the solver's slot arrays (as Plan.to_dict), no per-node tuples.
    layers = [split_slots(layer.flat, layer.sizes) for layer in plan.layers]
    zones = zone_survival(cube_presence(plan.count_cube), [n.zone for n in plan.nodes])
    return {
        "nodes": len(plan.nodes),
        "slots": plan.nodes[0].slots,
        "experts": plan.experts,
        "layers": len(plan.layers),
        "min_replicas": plan.min_replicas,
        "policy": plan.policy,
        "replicas": [list(layer.replicas) for layer in plan.layers],
        "placement": layers,
        "node_names": list(node_index),
        "recovery": plan.recovery,
        "zone_survival": zones,
        # The chance the model survives when one zone, chosen uniformly, goes down whole.
        "zone_loss_recovery": sum(zones.values()) / len(zones),
    }


def nodes_per_expert(plan: Plan, layer: int = 0) -> list[int]:
    return [sum(e in slots for slots in plan.layers[layer].placement)
            for e in range(plan.experts)]


def render_table(plans: dict[str, Plan], failures: int) -> str:
    first = next(iter(plans.values()))
    lines = [f"{len(first.nodes)} nodes x {first.nodes[0].slots} slots, {first.experts} experts, "
             f"{len(first.layers)} layer(s), min replicas {first.min_replicas}", ""]
    lines.append("expert  replicas  " + "  ".join(f"nodes({p})" for p in plans))
    per_policy = {p: nodes_per_expert(plan) for p, plan in plans.items()}
    for e in range(first.experts):
        cells = "  ".join(f"{per_policy[p][e]:>{len(p) + 7}}" for p in plans)
        lines.append(f"{e:>6}  {first.layers[0].replicas[e]:>8}  {cells}")
    lines += ["", "recovery probability (whole model) with k failed nodes",
              "k   " + "  ".join(f"{p:>8}" for p in plans)]
    for k in range(1, failures + 1):
        lines.append(f"{k:<3} " + "  ".join(f"{plan.recovery[str(k)]:>8.3f}"
                                            for plan in plans.values()))
    zones = {p: zone_survival(cube_presence(plan.count_cube), [n.zone for n in plan.nodes])
             for p, plan in plans.items()}
    if len(next(iter(zones.values()))) > 1:
        lines.append("zone  " + "  ".join(f"{p:>8}" for p in plans))
        for z in sorted(next(iter(zones.values()))):
            lines.append(f"{z:<5} " + "  ".join(
                f"{'survives' if zones[p][z] else 'LOST':>8}" for p in plans))
    return "\n".join(lines)
