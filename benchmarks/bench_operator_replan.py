"""How fast the operator re-plans a large job after losing nodes, and what it costs.

A kwok cluster (hack/cluster.sh, its own instance) gets N simulated GPU spot nodes over four
zones and one LazarusJob of J nodes. The real operator runs as a subprocess. Each run deletes
5% of the job's nodes at once and measures the time to the new plan generation being
readable in its ConfigMap, from two moments: the first deletion request, and the moment the
API server's watch has delivered the last deletion (what the operator can act on: the time
before it is the API server's, on the shared cores of a test machine); then new nodes are
added and the job grows back before the next run. The operator's CPU time and peak memory
are sampled throughout.

    hack/bench.sh benchmarks/bench_operator_replan.py [--nodes 1000] [--job-nodes 512] [--runs 5]

Prints a table. Targets (issue 18): the plan without every lost node at p99 < 1 s, operator
memory < 300 MiB, at 1,000 nodes with a 512-node job and at 2,000 with a 1,024-node job.
Beside the cluster figures it times the re-plan itself in this process, ours against the
EPLB-style baseline of bench_solver.py, for the job's shape.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import yaml

from lazarus_core.cluster_contract import GROUP, PLAN_KEY, PLURAL, VERSION, read_plan_configmap
from testcluster import local
from testcluster.kube import api_client
from testcluster.nodepools import build_node, load_pools

ROOT = Path(__file__).resolve().parents[1]
ZONES = 4


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1000, help="simulated GPU nodes in the cluster")
    p.add_argument("--job-nodes", type=int, default=512, help="nodes the job runs on")
    p.add_argument("--lose-percent", type=int, default=5, help="share of the job's nodes deleted at once")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--cluster", default="lazarus-bench", help="hack/cluster.sh cluster name")
    p.add_argument("--keep-cluster", action="store_true", help="leave the cluster running")
    p.add_argument("--timeout", type=float, default=900, help="bound on each wait, seconds")
    args = p.parse_args()

    # kwokctl's own heartbeat factor for clusters of thousands of nodes: what is measured is
    # the operator, not nodes that a simulator on the same 2 cores renews too late.
    kubeconfig, _ = local.up(args.cluster, heartbeat_factor=5)
    from kubernetes import client

    api = api_client(str(kubeconfig))
    api.rest_client.pool_manager.connection_pool_kw["maxsize"] = 32
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})
    _apply_crds(client.ApiextensionsV1Api(api))
    pools = load_pools()
    pool = pools.pool("gpu-spot")
    pool_threads = ThreadPoolExecutor(16)
    serial = iter(range(10**9))

    def add_nodes(count: int) -> list[str]:
        names = []
        nodes = []
        for _ in range(count):
            i = next(serial)
            zone = f"{ns}-z{i % ZONES}"
            name = f"{zone}-{i}"
            node = build_node(pool, pools.region, zone, name)
            node["metadata"]["labels"]["lazarus.dev/bench"] = ns
            nodes.append(node)
            names.append(name)
        list(pool_threads.map(core.create_node, nodes))
        return names

    def delete_nodes(names: list[str]) -> None:
        list(pool_threads.map(core.delete_node, names))

    operator = None
    try:
        t = time.monotonic()
        add_nodes(args.nodes)
        print(f"created {args.nodes} simulated nodes in {time.monotonic() - t:.0f} s", flush=True)
        metrics_port = 18080 + os.getpid() % 1000
        log_path = Path(tempfile.gettempdir()) / f"lazarus-operator-{ns}.log"
        print(f"operator log: {log_path}", flush=True)
        log = open(log_path, "w")
        operator = subprocess.Popen(
            [sys.executable, "-m", "lazarus_operator", f"--namespace={ns}", "--standalone",
             f"--metrics-port={metrics_port}", "--liveness=", "--start-grace-seconds=30"],
            env=dict(os.environ, KUBECONFIG=str(kubeconfig)), stdout=log, stderr=subprocess.STDOUT)
        sampler = Sampler(operator.pid)
        custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, _job(ns, args.job_nodes))

        watcher = PlanWatcher(api, ns, "bench-plan")
        deletions = DeletionWatcher(api, f"lazarus.dev/bench={ns}")

        def plan() -> dict | None:
            return watcher.latest

        t = time.monotonic()
        full = _wait(lambda: (pl := plan()) and len(pl["nodes"]) == args.job_nodes and pl,
                     args.timeout, f"the job to run on {args.job_nodes} nodes")
        print(f"job running on {args.job_nodes} nodes (generation {full['generation']}) after "
              f"{time.monotonic() - t:.0f} s", flush=True)
        lose = max(1, math.ceil(args.job_nodes * args.lose_percent / 100))
        first_plan, all_out, cpu_per_replan, acked = [], [], [], []
        visible, from_visible = [], []
        for run in range(args.runs):
            time.sleep(3)  # let the previous growth's fan-out settle
            before = plan()
            victims = [n["name"] for n in before["nodes"]][run::max(1, args.job_nodes // lose)][:lose]
            cpu0 = sampler.cpu()
            t0 = time.monotonic()
            delete_nodes(victims)
            acked.append(time.monotonic() - t0)  # the API server has taken every deletion
            # The operator acts on each deletion it sees at once, so the deletions may land in
            # more than one generation; both the first one and the one without any victim count.
            first = _wait(lambda: watcher.first_after(before["generation"]), args.timeout,
                          "the new plan", interval=0.01)
            first_plan.append(first[1] - t0)
            first = first[0]
            after, seen = _wait(lambda: watcher.first_without(set(victims), before["generation"]),
                                args.timeout, "a plan without any deleted node", interval=0.01)
            all_out.append(seen - t0)
            last_seen = _wait(lambda: deletions.last(victims), args.timeout,
                              "the watch to deliver every deletion", interval=0.01)
            visible.append(last_seen - t0)
            from_visible.append(seen - last_seen)
            cpu_per_replan.append(sampler.cpu() - cpu0)
            print(f"run {run + 1}: lost {lose} nodes (deletions answered after {acked[-1]:.2f} s, "
                  f"all delivered by the watch after {visible[-1]:.2f} s, plan without them "
                  f"{from_visible[-1]:.2f} s after that); "
                  f"generation {first['generation']} after {first_plan[-1]:.2f} s, all excluded "
                  f"in generation {after['generation']} ({len(after['nodes'])} nodes) after "
                  f"{all_out[-1]:.2f} s", flush=True)
            add_nodes(lose)
            # No real workers run here, so the benchmark reports their steps, as rank 0
            # would: growth waits for a step boundary, and a report also tells the operator
            # the workers now hold the plan's experts.
            steps = iter(range(10**6))
            _wait(lambda: _report_progress(core, ns, plan(), next(steps)) and
                  len(plan()["nodes"]) == args.job_nodes, args.timeout,
                  "the job to grow back", interval=0.5)
            _report_progress(core, ns, plan(), next(steps))
        _report(args, lose, first_plan, all_out, cpu_per_replan, acked, visible, from_visible,
                sampler)
    finally:
        if operator is not None:
            operator.terminate()
            try:
                operator.wait(timeout=30)
            except subprocess.TimeoutExpired:  # still draining its watches: the cluster
                operator.kill()                # below must go down all the same
                operator.wait()
        core.delete_namespace(ns)
        nodes = core.list_node(label_selector=f"lazarus.dev/bench={ns}").items
        delete_nodes([n.metadata.name for n in nodes])
        if not args.keep_cluster:
            local.down(args.cluster)
    return 0


class PlanWatcher:
    """Every version of the plan ConfigMap, stamped with when the watch delivered it: a
    watch adds no load of its own, unlike polling a large ConfigMap."""

    def __init__(self, api, ns: str, name: str):
        self.seen: list[tuple[dict, float]] = []
        self.latest: dict | None = None
        threading.Thread(target=self._run, args=(api, ns, name), daemon=True).start()

    def _run(self, api, ns, name):
        from kubernetes import client

        for event in _watch(client.CoreV1Api(api).list_namespaced_config_map, ns,
                            field_selector=f"metadata.name={name}"):
            at = time.monotonic()
            data = event["object"].data or {}
            if event["type"] != "DELETED" and PLAN_KEY in data:
                plan = read_plan_configmap(data)[0].to_dict()
                self.seen.append((plan, at))
                self.latest = plan

    def first_after(self, generation: int):
        return next(((p, t) for p, t in list(self.seen) if p["generation"] > generation), None)

    def first_without(self, names: set[str], generation: int):
        return next(((p, t) for p, t in list(self.seen) if p["generation"] > generation
                     and not names & {n["name"] for n in p["nodes"]}), None)


class DeletionWatcher:
    """When a watch on the nodes delivered each deletion: the moment the operator's own watch
    can deliver it too."""

    def __init__(self, api, selector: str):
        self.deleted: dict[str, float] = {}
        threading.Thread(target=self._run, args=(api, selector), daemon=True).start()

    def _run(self, api, selector):
        from kubernetes import client

        for event in _watch(client.CoreV1Api(api).list_node, label_selector=selector):
            if event["type"] == "DELETED":
                self.deleted[event["object"].metadata.name] = time.monotonic()

    def last(self, names) -> float | None:
        seen = [self.deleted.get(n) for n in names]
        return None if None in seen else max(seen)


def _watch(list_fn, *args, **kwargs):
    """Every event of a watch, for ever: each re-opened watch (the server ends one after
    300 s) carries on from the last event seen, so nothing that happens while it re-opens
    is missed (a fresh watch starts from the present: a run whose deletions came then
    would wait for them until its timeout)."""
    from kubernetes import watch

    version = None
    while True:
        seen = 0
        try:
            for event in watch.Watch().stream(list_fn, *args, timeout_seconds=300,
                                              **({"resource_version": version} if version
                                                 else {}), **kwargs):
                version = event["object"].metadata.resource_version
                seen += 1
                yield event
        except Exception:  # noqa: BLE001 - a dropped watch is re-opened
            time.sleep(0.1)
        if not seen:
            # Too old a version to carry on from (the client ends such a watch without a
            # word), or nothing happened for 300 s: start from the present.
            version = None


class Sampler:
    """Peak resident memory and CPU time of the operator process, sampled every 100 ms."""

    def __init__(self, pid: int):
        self.proc = psutil.Process(pid)
        self.peak_rss = 0
        self.started = time.monotonic()
        self.cpu_start = self.cpu()
        threading.Thread(target=self._run, daemon=True).start()

    def cpu(self) -> float:
        t = self.proc.cpu_times()
        return t.user + t.system

    def _run(self) -> None:
        while True:
            try:
                self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)
            except psutil.NoSuchProcess:
                return
            time.sleep(0.1)


def _report_progress(core, ns: str, plan: dict, step: int) -> bool:
    from kubernetes import client

    pods = core.list_namespaced_pod(ns, label_selector="lazarus.dev/job=bench").items
    on = {p.spec.node_name: p.metadata.name for p in pods if p.spec.node_name}
    rank0 = on.get(plan["nodes"][0]["name"])
    if rank0 is not None:
        try:
            core.patch_namespaced_pod(rank0, ns, {"metadata": {"annotations": {
                "lazarus.dev/progress": json.dumps({"step": step,
                                                    "generation": plan["generation"]})}}})
        except client.ApiException:
            pass
    return True


def _percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _report(args, lose, first_plan, all_out, cpu_per_replan, acked, visible, from_visible,
            sampler: Sampler) -> None:
    wall = time.monotonic() - sampler.started
    rows = [
        ("cluster nodes / job nodes / lost at once", f"{args.nodes} / {args.job_nodes} / {lose}"),
        ("runs", str(len(all_out))),
        ("deletions answered by the API server, p50 / max",
         f"{statistics.median(acked):.2f} / {max(acked):.2f} s"),
        ("deletion -> first new plan, p50 / p99", f"{statistics.median(first_plan):.2f} / "
                                                  f"{_percentile(first_plan, 0.99):.2f} s"),
        ("deletion -> plan without every lost node, p50", f"{statistics.median(all_out):.2f} s"),
        ("deletion -> plan without every lost node, p99", f"{_percentile(all_out, 0.99):.2f} s"),
        ("deletion -> watch delivered the last deletion, p50 / max",
         f"{statistics.median(visible):.2f} / {max(visible):.2f} s"),
        ("last deletion delivered -> plan without every lost node, p50",
         f"{statistics.median(from_visible):.2f} s"),
        ("last deletion delivered -> plan without every lost node, p99",
         f"{_percentile(from_visible, 0.99):.2f} s  (target < 1 s)"),
        ("operator CPU per re-plan (median)", f"{statistics.median(cpu_per_replan):.2f} s"),
        ("operator CPU, whole benchmark", f"{sampler.cpu() - sampler.cpu_start:.1f} s over "
                                          f"{wall:.0f} s wall ({100 * (sampler.cpu() - sampler.cpu_start) / wall:.0f}% of a core)"),
        ("operator peak memory (RSS)", f"{sampler.peak_rss / 2**20:.0f} MiB  (target < 300 MiB)"),
    ]
    rows += _solver_rows(args.job_nodes, lose)
    width = max(len(k) for k, _ in rows)
    print()
    print(f"{'metric':<{width}}  value")
    print(f"{'-' * width}  {'-' * 40}")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def _solver_rows(job_nodes: int, lose: int) -> list[tuple[str, str]]:
    """The re-plan alone, in this process: ours against the EPLB-style baseline, as ratios."""
    from bench_solver import cpu_ms, eplb_plan

    from lazarus_core.migration import plan_transfers
    from lazarus_core.solver import plan_job, replan
    from lazarus_core.topology import NodeSpec

    nodes = [NodeSpec(f"node-{i}", 1, 6, zone=f"z{i % ZONES}", capacity_type="spot")
             for i in range(job_nodes)]
    plan = plan_job(nodes, 16, 12, 2, "mro", max_failures=5)
    gone = {n.name for n in plan.nodes[::max(1, job_nodes // lose)][:lose]}
    survivors = [n for n in nodes if n.name not in gone]
    names = {n.name for n in survivors}
    ours_ms, ours = cpu_ms(lambda: replan(plan, survivors, "NodeLost", names, max_failures=5), 3)
    equal = [[1.0] * 16] * 12
    base = eplb_plan(nodes, equal, 16, 1, "Initial")
    base_ms, theirs = cpu_ms(
        lambda: plan_transfers(base, eplb_plan(survivors, equal, 16, 2, "NodeLost"), names), 3)
    return [
        ("re-plan + migration in process: ours / EPLB-style",
         f"{ours_ms:.0f} / {base_ms:.0f} ms ({ours_ms / base_ms:.2f}x)"),
        ("replicas moved: ours / EPLB-style",
         f"{ours.migration.experts_migrated} / {theirs.experts_migrated} "
         f"({ours.migration.experts_migrated / max(theirs.experts_migrated, 1):.2f}x)"),
        ("published plan: ours / EPLB-style",
         f"{len(ours.plan.to_compact_json()) / 1024:.0f} / {len(base.to_compact_json()) / 1024:.0f} "
         f"KiB (compressed; {len(ours.plan.to_json()) / 1024:.0f} KiB as plain JSON)"),
    ]


def _job(ns: str, nodes: int) -> dict:
    # GPT-L-like: 12 MoE layers, 16 experts, 6 slots per GPU (paper-notes.md), f = 2.
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "LazarusJob",
        "metadata": {"name": "bench", "namespace": ns},
        "spec": {
            "runtime": {"model": "gpt-l", "experts": 16, "layers": 12,
                        "globalBatch": max(8, nodes)},  # a sample per rank at least
            "minNodes": nodes // 2, "maxNodes": nodes, "replicas": nodes,
            "gpusPerNode": 1, "slotsPerGpu": 6, "minReplicas": 2,
            "template": {
                "resources": {"limits": {"nvidia.com/gpu": 1}},
                "nodeSelector": {"lazarus.dev/bench": ns},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"},
                                {"key": "cloud.google.com/gke-spot", "operator": "Exists"}],
            },
        },
    }


def _apply_crds(ext) -> None:
    from kubernetes import client

    for doc in yaml.safe_load_all((ROOT / "crds" / "lazarusjob.yaml").read_text()):
        try:
            ext.create_custom_resource_definition(doc)
        except client.ApiException as e:
            if e.status != 409:
                raise
    _wait(lambda: any(c.type == "Established" and c.status == "True" for c in
                      ext.read_custom_resource_definition("lazarusjobs.lazarus.dev").status.conditions or []),
          60, "the CRD")


def _wait(check, timeout: float, what: str, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if result:
                return result
        except Exception:  # noqa: BLE001 - transient API errors retry until the deadline
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


if __name__ == "__main__":
    sys.exit(main())
