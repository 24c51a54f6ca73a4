"""The simulated node pools described in hack/nodepools.yaml, as Node objects for the local
kwok cluster and as worker nodes for a kind cluster.

The builders are pure; ``apply_nodes`` and ``advertise_extended_resources`` talk to the API.
Run ``python -m testcluster.nodepools --help`` for the shell entry points.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

DEFAULT_POOLS_FILE = Path(__file__).resolve().parents[2] / "hack" / "nodepools.yaml"

POOL_LABEL = "lazarus.dev/pool"
ZONE_LABEL = "topology.kubernetes.io/zone"
# kwok's convention for the nodes it simulates; the fault injectors use it to tell kwok's nodes
# from kind's.
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
GPU_RESOURCE = "nvidia.com/gpu"
CAPACITY_TYPES = ("on-demand", "spot")


@dataclass(frozen=True)
class Pool:
    """One node pool: identical nodes spread over zones."""

    name: str
    capacity_type: str
    instance_type: str
    zones: tuple[str, ...]
    nodes_per_zone: int
    resources: dict[str, str]
    taints: tuple[dict, ...] = ()
    gpu_product: str | None = None

    @property
    def is_spot(self) -> bool:
        return self.capacity_type == "spot"

    @property
    def num_gpus(self) -> int:
        return int(self.resources.get(GPU_RESOURCE, "0"))

    def node_names(self) -> list[tuple[str, str]]:
        """(node name, zone) for every node of the pool."""
        return [
            (f"{self.name}-{zone}-{i}", zone)
            for zone in self.zones
            for i in range(self.nodes_per_zone)
        ]


@dataclass(frozen=True)
class NodePools:
    region: str
    pools: tuple[Pool, ...] = field(default_factory=tuple)

    def pool(self, name: str) -> Pool:
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise KeyError(f"no pool named {name!r}; pools: {[p.name for p in self.pools]}")


def load_pools(path: Path = DEFAULT_POOLS_FILE) -> NodePools:
    """Read and check a node pool description."""
    raw = yaml.safe_load(Path(path).read_text())
    pools = []
    for i, p in enumerate(raw.get("pools") or []):
        where = f"{path}: pools[{i}]"
        if p.get("capacityType") not in CAPACITY_TYPES:
            raise ValueError(f"{where}.capacityType must be one of {CAPACITY_TYPES}, got {p.get('capacityType')!r}")
        if not p.get("zones"):
            raise ValueError(f"{where}.zones must list at least one zone")
        if int(p.get("nodesPerZone", 1)) < 1:
            raise ValueError(f"{where}.nodesPerZone must be at least 1")
        pools.append(Pool(
            name=p["name"],
            capacity_type=p["capacityType"],
            instance_type=p["instanceType"],
            zones=tuple(p["zones"]),
            nodes_per_zone=int(p.get("nodesPerZone", 1)),
            resources={k: str(v) for k, v in p["resources"].items()},
            taints=tuple(p.get("taints") or ()),
            gpu_product=p.get("gpuProduct"),
        ))
    names = [p.name for p in pools]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: pool names must be unique, got {names}")
    return NodePools(region=raw["region"], pools=tuple(pools))


def build_labels(pool: Pool, region: str, zone: str) -> dict[str, str]:
    """The labels a real cloud puts on a node of this pool, in every cloud's spot style."""
    labels = {
        POOL_LABEL: pool.name,
        ZONE_LABEL: zone,
        "topology.kubernetes.io/region": region,
        "node.kubernetes.io/instance-type": pool.instance_type,
        "karpenter.sh/capacity-type": pool.capacity_type,
        "eks.amazonaws.com/capacityType": "SPOT" if pool.is_spot else "ON_DEMAND",
    }
    if pool.is_spot:
        labels["cloud.google.com/gke-spot"] = "true"
    if pool.num_gpus:
        # What NVIDIA's GPU feature discovery would label.
        labels["nvidia.com/gpu.present"] = "true"
        labels["nvidia.com/gpu.count"] = str(pool.num_gpus)
        if pool.gpu_product:
            labels["nvidia.com/gpu.product"] = pool.gpu_product
    return labels


def build_node(pool: Pool, region: str, zone: str, name: str) -> dict:
    """A Node object for kwok to simulate."""
    labels = build_labels(pool, region, zone) | {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {KWOK_NODE_ANNOTATION: "fake"},
        },
        "spec": {"taints": [dict(t) for t in pool.taints]},
        "status": {"capacity": dict(pool.resources), "allocatable": dict(pool.resources)},
    }


def build_nodes(node_pools: NodePools) -> list[dict]:
    return [
        build_node(pool, node_pools.region, zone, name)
        for pool in node_pools.pools
        for name, zone in pool.node_names()
    ]


def build_kind_config(node_pools: NodePools, cluster_name: str) -> dict:
    """A kind cluster with one worker per pool and zone, labelled and tainted like the pool.

    kind cannot fake GPUs; ``advertise_extended_resources`` adds them once the nodes exist.
    """
    workers = []
    for pool in node_pools.pools:
        for zone in pool.zones:
            worker = {"role": "worker", "labels": build_labels(pool, node_pools.region, zone)}
            if pool.taints:
                # Taints at registration, so nothing slips onto the node before they land.
                join = {
                    "kind": "JoinConfiguration",
                    "nodeRegistration": {"taints": [dict(t) for t in pool.taints]},
                }
                worker["kubeadmConfigPatches"] = [yaml.safe_dump(join)]
            workers.append(worker)
    return {
        "kind": "Cluster",
        "apiVersion": "kind.x-k8s.io/v1alpha4",
        "name": cluster_name,
        "nodes": [{"role": "control-plane"}, *workers],
    }


def apply_nodes(core, nodes: list[dict]) -> list[str]:
    """Create the nodes that are missing, and return their names. Existing nodes are left as
    they are, so a fault a test injected is not silently undone."""
    from kubernetes.client.exceptions import ApiException

    created = []
    for node in nodes:
        name = node["metadata"]["name"]
        try:
            core.create_node(node)
        except ApiException as e:
            if e.status != 409:
                raise
            continue
        # The API server may drop status on create; kwok keeps whatever allocatable it finds.
        core.patch_node_status(name, {"status": node["status"]})
        created.append(name)
    return created


def advertise_extended_resources(core, node_pools: NodePools) -> list[str]:
    """Give each pool node the extended resources (nvidia.com/gpu) its pool declares.

    For kind, whose kubelets have no device plugin: the kubelet keeps extended resources that
    someone else put in the node status (until it restarts).
    """
    patched = []
    for node in core.list_node(label_selector=POOL_LABEL).items:
        pool = node_pools.pool(node.metadata.labels[POOL_LABEL])
        extended = {k: v for k, v in pool.resources.items() if "/" in k}
        if extended:
            core.patch_node_status(
                node.metadata.name, {"status": {"capacity": extended, "allocatable": extended}}
            )
            patched.append(node.metadata.name)
    return patched


def take_over_node_leases(coordination, names: list[str], since: float,
                          timeout_s: float = 120.0) -> None:
    """Make the kwok started at ``since`` (epoch s) simulate the nodes in ``names`` now.

    kwok simulates a node only while it holds the node's Lease, and a restarted kwok has a
    new identity: it would wait for the leases of its previous run to expire (40 s) before
    it takes them over, and pods bound to those nodes would not start until then. Leases not
    renewed since ``since`` belong to that dead run, so they are deleted; the new kwok
    creates its own at its next try (within 10 s). Returns once it holds them all."""
    import time

    from kubernetes.client.exceptions import ApiException

    deadline = time.monotonic() + timeout_s
    while True:
        leases = {lease.metadata.name: lease for lease in
                  coordination.list_namespaced_lease("kube-node-lease").items}
        stale = [n for n in names if n not in leases or leases[n].spec.renew_time is None
                 or leases[n].spec.renew_time.timestamp() < since]
        if not stale:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"kwok did not take over the leases of {', '.join(stale)} "
                               f"within {timeout_s:.0f} s")
        for name in (n for n in stale if n in leases):
            try:
                coordination.delete_namespaced_lease(name, "kube-node-lease")
            except ApiException as e:
                if e.status != 404:
                    raise
        time.sleep(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testcluster.nodepools", description=__doc__)
    parser.add_argument("--pools", type=Path, default=DEFAULT_POOLS_FILE, help="node pool description")
    commands = parser.add_subparsers(dest="command", required=True)
    apply = commands.add_parser("apply", help="create the simulated nodes that are missing")
    apply.add_argument("--kubeconfig", required=True)
    apply.add_argument("--since", type=float, default=0.0,
                       help="when kwok was (re)started: wait until it holds every pool node's lease")
    kind = commands.add_parser("kind-config", help="print a kind cluster config (JSON, valid YAML)")
    kind.add_argument("--name", required=True)
    advertise = commands.add_parser("advertise-gpus", help="add pool GPUs to kind's node status")
    advertise.add_argument("--kubeconfig", required=True)
    args = parser.parse_args(argv)

    node_pools = load_pools(args.pools)
    if args.command == "kind-config":
        json.dump(build_kind_config(node_pools, args.name), sys.stdout, indent=2)
        print()
        return 0

    from testcluster.kube import core_v1

    core = core_v1(args.kubeconfig)
    if args.command == "apply":
        nodes = build_nodes(node_pools)
        created = apply_nodes(core, nodes)
        print(f"{len(nodes)} simulated nodes ({len(created)} created)", file=sys.stderr)
        from testcluster.kube import api_client
        from kubernetes import client

        coordination = client.CoordinationV1Api(api_client(args.kubeconfig))
        take_over_node_leases(coordination, [n["metadata"]["name"] for n in nodes], args.since)
    else:
        patched = advertise_extended_resources(core, node_pools)
        print(f"advertised extended resources on {len(patched)} nodes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
