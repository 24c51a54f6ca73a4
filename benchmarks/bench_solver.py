"""Solver benchmark: our plan and re-plan against an EPLB-style greedy baseline, one core.

    hack/bench.sh benchmarks/bench_solver.py [--repeats 3] [--draws 8] [--shapes]

Cases, all with f=2 and zipf(1.0) expert loads that rotate across layers:
- the paper's testbed: N=10 nodes x 1 GPU x 6 slots, E=16, L=12;
- 256 GPUs: 32 nodes x 8 GPUs x 4 slots, E=256, L=58: as many experts as one node's slots
  times eight, where the recovery-first structure leaves the ranks out of balance and the
  solver searches longest (its cold experts spread evenly: docs/placement.md);
- 1,024 GPUs: 128 nodes x 8 GPUs x 4 slots, E=256, L=58 (DeepSeek-V3-like);
- 4,096 GPUs: 512 nodes x 8 GPUs x 4 slots, E=256, L=61;
and 1,024 GPUs again with loads whose layers differ in shape, as measured routing does
(``lazarus_sim.workload.differing_loads``: zipf 0.4-1.0 per layer, noise, random order):
rotated zipf loads give every layer the same shape, which the solver plans once; and with
such loads more skewed (zipf 0.8-1.4), where none of the search's first options has its
ranks within 1.05 (with 4 slots a rank, the coldest experts' slots leave the hot replicas
too few ranks) and the plan takes counts whose cold experts fill their cores
(``allocation.filling_cores``; docs/placement.md, stop 57; until then the search ran to
its end, 4-6 s, at 1.0497).

``--shapes`` runs other shapes near 1,024 GPUs instead (``SHAPES``: 2 slots a GPU, E=512,
zipf 2.0, 124, 256 and 16 nodes, 4 GPUs a node), which the issue sets no target for: an
independent sweep found plans and re-plans of seconds there (stop 52).

The baseline is DeepSeek EPLB's idea: start every expert at f replicas, give each extra
replica to the expert with the highest load per replica, then pack replicas heaviest-first
onto the least-loaded node with a free slot. It has no migration planner, so after a loss its
nodes keep their identities (identity mapping). A loss is 4 nodes chosen at random (``--draws``
draws, the same for both); moves are averaged over every draw, and a draw where some expert
lost every replica (only a checkpoint restores it) is counted apart.

Times are CPU time of this process (median of ``--repeats``; the re-plan's of the first
draw, and the slowest draw's, each draw timed once), its malloc set as the operator
and the command line set theirs (``lazarus_core.malloc.keep_plan_heap``); "lazarus plan"
rows run the command line as a whole process. Memory is the peak Python allocation while planning
(tracemalloc), and for the command line the peak resident size. The last column is the
target of issue 18 where it sets one.
"""
from __future__ import annotations

import argparse
import heapq
import math
import os
import statistics
import subprocess
import sys
import time
import tracemalloc

os.environ.setdefault("OMP_NUM_THREADS", "1")  # "on one core": keep BLAS single-threaded
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import psutil  # noqa: E402

from lazarus_core.balance import busiest_rank  # noqa: E402
from lazarus_core.malloc import keep_plan_heap  # noqa: E402
from lazarus_core.migration import holdings, plan_transfers, preload  # noqa: E402
from lazarus_core.anchor_search import (best_anchors, cores_key, forget_anchors,  # noqa: E402
                                        scored_failures)
from lazarus_core.mro import per_replica  # noqa: E402
from lazarus_core.plan import Plan  # noqa: E402
from lazarus_core.recovery import recovery_probability  # noqa: E402
from lazarus_core.solver import _positions, build_plan, plan_job, replan  # noqa: E402
from lazarus_core.topology import NodeSpec  # noqa: E402
from lazarus_sim.workload import differing_loads  # noqa: E402

CASES = {
    "paper (N=10, c=6, E=16, L=12)": dict(nodes=10, gpus=1, slots=6, experts=16, layers=12),
    "256 GPUs (32x8x4, E=256, L=58)": dict(nodes=32, gpus=8, slots=4, experts=256, layers=58),
    "1,024 GPUs (128x8x4, E=256, L=58)": dict(nodes=128, gpus=8, slots=4, experts=256,
                                              layers=58),
    "4,096 GPUs (512x8x4, E=256, L=61)": dict(nodes=512, gpus=8, slots=4, experts=256,
                                              layers=61),
    "1,024 GPUs, layers of zipf 0.4-1.0": dict(nodes=128, gpus=8, slots=4, experts=256,
                                              layers=58, differing=(0.7, 7)),
    "1,024 GPUs, layers of zipf 0.8-1.4": dict(nodes=128, gpus=8, slots=4, experts=256,
                                              layers=58, differing=(1.1, 7)),
}
# ``--shapes``: other shapes near 1,024 GPUs, none of them the issue's, so none has a target:
# fewer slots a GPU, more experts, more skew, other node sizes, and the independent sweep's
# off-nominal node counts (stop 52). Where the structure's first options do not balance,
# the search runs for seconds (docs/placement.md).
SHAPES = {
    "shape: 128x8x2 slots, E=256, L=58": dict(nodes=128, gpus=8, slots=2, experts=256,
                                              layers=58),
    "shape: 124x8x4 slots, E=256, L=58": dict(nodes=124, gpus=8, slots=4, experts=256,
                                              layers=58),
    "shape: 256x4x4 slots, E=256, L=58": dict(nodes=256, gpus=4, slots=4, experts=256,
                                              layers=58),
    "shape: 256x8x4 slots, E=256, L=58": dict(nodes=256, gpus=8, slots=4, experts=256,
                                              layers=58),
    "shape: 128x8x4 slots, E=512, L=24": dict(nodes=128, gpus=8, slots=4, experts=512,
                                              layers=24),
    "shape: 128x8x4 slots, zipf 2.0": dict(nodes=128, gpus=8, slots=4, experts=256,
                                           layers=58, zipf=2.0),
    "shape: 16x8x4 slots, E=64, L=16": dict(nodes=16, gpus=8, slots=4, experts=64,
                                            layers=16),
}
TARGETS = {  # (case prefix, metric) -> target
    ("1,024", "plan (ms)"): "< 100",
    ("1,024", "re-plan + migration (ms)"): "< 100",
    ("1,024", "re-plan + migration, slowest draw (ms)"): "< 100",
    ("4,096", "plan (ms)"): "< 1000",
    ("4,096", "plan, peak memory (MB)"): "< 500",
    ("4,096", "published plan (KiB)"): "< 512",
    ("paper", "max/mean load per rank"): "<= 1.05",
    ("256", "max/mean load per rank"): "<= 1.05",
    ("1,024", "max/mean load per rank"): "<= 1.05",
    ("4,096", "max/mean load per rank"): "<= 1.05",
    ("1,024", "lazarus plan --json, whole process (s)"): "< 1.5",
    ("4,096", "lazarus plan --json, whole process (s)"): "< 1",
    ("4,096", "lazarus plan --json, peak memory (MB)"): "< 500",
}
MIN_REPLICAS = 2
LOST = 4


def loads(experts: int, layers: int, skew: float = 1.0) -> list[list[float]]:
    return [[1 / (((e + l) % experts) + 1) ** skew for e in range(experts)]
            for l in range(layers)]


def case_loads(cfg) -> list[list[float]]:
    """The case's loads: rotated zipf (1.0 unless the case says), or layers of differing
    shape (skew, seed)."""
    if "differing" in cfg:
        return differing_loads(cfg["experts"], cfg["layers"], *cfg["differing"])
    return loads(cfg["experts"], cfg["layers"], cfg.get("zipf", 1.0))


def eplb_allocate(load: list[float], total_slots: int, f: int) -> list[int]:
    replicas = [f] * len(load)
    heap = [(-t / f, e) for e, t in enumerate(load)]
    heapq.heapify(heap)
    for _ in range(total_slots - f * len(load)):
        _, e = heapq.heappop(heap)
        replicas[e] += 1
        heapq.heappush(heap, (-load[e] / replicas[e], e))
    return replicas


def eplb_pack(load: list[float], replicas: list[int], slots: list[int]) -> list[list[int]]:
    items = sorted(((load[e] / r, e) for e, r in enumerate(replicas) for _ in range(r)),
                   reverse=True)
    placement = [[] for _ in slots]
    nodes = [(0.0, i) for i in range(len(slots))]
    for weight, e in items:
        total, i = heapq.heappop(nodes)
        placement[i].append(e)
        if len(placement[i]) < slots[i]:
            heapq.heappush(nodes, (total + weight, i))
    return placement


def eplb_layout(nodes: list[NodeSpec], layer_loads, f):
    slots = [n.slots for n in nodes]
    replicas = [eplb_allocate(l, sum(slots), f) for l in layer_loads]
    return replicas, [eplb_pack(l, r, slots) for l, r in zip(layer_loads, replicas)]


def eplb_plan(nodes, lo, experts, generation, reason) -> Plan:
    replicas, placements = eplb_layout(nodes, lo, MIN_REPLICAS)
    return build_plan(nodes, replicas, placements, experts, MIN_REPLICAS, "eplb", generation,
                      reason, 0)


def cpu_ms(fn, repeats):
    times, result = [], None
    for _ in range(repeats):
        forget_anchors()  # each run timed cold, as a fresh process plans
        start = time.process_time()
        result = fn()
        times.append(time.process_time() - start)
    return statistics.median(times) * 1000, result


def peak_mb(fn) -> float:
    forget_anchors()
    tracemalloc.start()
    fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak / 2**20


def recovery(plan: Plan, k: int) -> float:
    return recovery_probability([[list(s) for s in l.placement] for l in plan.layers],
                                k).probability


def run_case(name, cfg, repeats, draws):
    nodes = [NodeSpec(f"node-{i:03d}", cfg["gpus"], cfg["slots"], zone=f"zone-{i % 4}")
             for i in range(cfg["nodes"])]
    E, L = cfg["experts"], cfg["layers"]
    lo = case_loads(cfg)
    ours_ms, plan = cpu_ms(lambda: plan_job(nodes, E, L, MIN_REPLICAS, "mro", lo,
                                            max_failures=0), repeats)
    base_ms, baseline = cpu_ms(lambda: eplb_plan(nodes, lo, E, 1, "Initial"), repeats)
    rows = [(name, "plan (ms)", ours_ms, base_ms),
            (name, "plan, peak memory (MB)",
             peak_mb(lambda: plan_job(nodes, E, L, MIN_REPLICAS, "mro", lo, max_failures=0)),
             peak_mb(lambda: eplb_plan(nodes, lo, E, 1, "Initial"))),
            (name, "max/mean load per rank", busiest_rank(plan, lo), busiest_rank(baseline, lo))]
    for k in (2, LOST):
        rows.append((name, f"recovery, {k} nodes lost", recovery(plan, k), recovery(baseline, k)))
    rows.append((name, "published plan (KiB)", len(plan.to_compact_json()) / 1024,
                 len(baseline.to_compact_json()) / 1024))

    rng = np.random.default_rng(18)
    moved, base_moved, held, after_imbalance = [], [], [], []
    re_times, base_re_times = [], []
    unrecoverable = [0, 0]
    for draw in range(draws):
        gone = {nodes[i].name for i in rng.choice(len(nodes), LOST, replace=False)}
        survivors = [n for n in nodes if n.name not in gone]
        names = {n.name for n in survivors}

        def ours():
            return replan(plan, survivors, "NodeLost", names, lo, max_failures=0)

        def theirs():
            return plan_transfers(baseline, eplb_plan(survivors, lo, E, 2, "NodeLost"), names)

        # The first draw timed as the median of ``repeats``, the others once each: a draw
        # whose loss cannot be carried over is made afresh, seconds where the first draw
        # took milliseconds (1,024 GPUs, zipf 0.8-1.4: 56 ms and 4.5 s).
        re_ms, result = cpu_ms(ours, repeats if draw == 0 else 1)
        base_re_ms, base_result = cpu_ms(theirs, repeats if draw == 0 else 1)
        if draw == 0:
            rows.append((name, "re-plan + migration (ms)", re_ms, base_re_ms))
        re_times.append(re_ms)
        base_re_times.append(base_re_ms)
        moved.append(result.migration.experts_migrated)
        base_moved.append(base_result.experts_migrated)
        unrecoverable[0] += not result.migration.recoverable
        unrecoverable[1] += not base_result.recoverable
        held.append(sum(len(es) for n in gone for es in holdings(plan)[n]))
        after_imbalance.append(busiest_rank(result.plan, lo))
    rows += [
        (name, f"replicas moved after losing {LOST} nodes", statistics.mean(moved),
         statistics.mean(base_moved)),
        (name, "  ...replicas the lost nodes held", statistics.mean(moved),
         statistics.mean(held)),
        (name, f"  ...draws with an expert lost (of {draws})", unrecoverable[0],
         unrecoverable[1]),
        (name, "max/mean load per rank after the loss", max(after_imbalance), None),
        (name, "re-plan + migration, slowest draw (ms)", max(re_times),
         max(base_re_times)),
    ]
    return rows


def search_gain(name, cfg):
    """Recovery of the most fragile layer's structure: construction alone, then searched."""
    nodes = [NodeSpec(f"node-{i:03d}", cfg["gpus"], cfg["slots"]) for i in range(cfg["nodes"])]
    E, L = cfg["experts"], cfg["layers"]
    lo = loads(E, L)
    ordered, replicas = _positions(nodes, E, L, MIN_REPLICAS, lo)
    slots = [n.slots for n in ordered]
    probe = min(range(L), key=lambda li: (sorted(replicas[li]), li))
    weights = per_replica(replicas, lo).tolist()[probe]
    n, k = len(slots), scored_failures(len(slots))
    rows = []
    keys = [cores_key(best_anchors(replicas[probe], slots, weights, search=s), n, k)
            for s in (True, False)]
    for failed in (2, 3, 4):
        if failed <= len(keys[0]) and failed <= len(keys[1]):
            total = math.comb(n, failed)
            rows.append((name, f"local search: recovery, {failed} lost (vs construction)",
                         1 - keys[0][failed - 1] / total, 1 - keys[1][failed - 1] / total))
    return rows


def cli_rows(case, nodes, slots, layers, repeats):
    """`lazarus plan --json` as a user runs it: wall time (median) and peak resident size,
    sampled every 5 ms while it runs."""
    args = [sys.executable, "-m", "lazarus_cli.main", "plan", "--nodes", str(nodes), "--slots",
            str(slots), "--experts", "256", "--layers", str(layers), "--json"]
    walls, peak = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        proc = psutil.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while proc.poll() is None:
            try:
                peak = max(peak, proc.memory_info().rss)
            except psutil.Error:
                break
            time.sleep(0.005)
        walls.append(time.perf_counter() - start)
        assert proc.returncode == 0, args
    return [(case, "lazarus plan --json, whole process (s)", statistics.median(walls), None),
            (case, "lazarus plan --json, peak memory (MB)", peak / 2**20, None)]


def target(case: str, metric: str) -> str:
    return next((t for (prefix, m), t in TARGETS.items()
                 if case.startswith(prefix) and metric == m), "")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--draws", type=int, default=8)
    parser.add_argument("--shapes", action="store_true",
                        help="the other shapes near 1,024 GPUs (SHAPES) instead of the cases")
    args = parser.parse_args()
    keep_plan_heap()
    # What the operator imports at start-up: else the first re-plan timed waits about 1 s
    # for scipy (the first shape's, in a ``--repeats 1`` run).
    preload()
    rows = []
    for name, cfg in (SHAPES if args.shapes else CASES).items():
        rows += run_case(name, cfg, args.repeats, args.draws)
    if not args.shapes:
        for name in CASES:
            if name.startswith(("paper", "1,024")) and "differing" not in CASES[name]:
                rows += search_gain(name, CASES[name])
        rows += cli_rows("1,024 GPUs (128 x 32 slots, CLI)", 128, 32, 58, args.repeats)
        rows += cli_rows("4,096 GPUs (512 x 32 slots, CLI)", 512, 32, 61, args.repeats)
    print(f"{'case':<36} {'metric':<52} {'lazarus':>10} {'baseline':>10} {'ratio':>7} "
          f"{'target':>8}")
    for case, metric, ours, base in rows:
        fmt = "{:>10.1f}" if isinstance(ours, int) or ours >= 10 else "{:>10.3f}"
        base_s = fmt.format(base) if base is not None else f"{'':>10}"
        ratio = f"{ours / base:>7.2f}" if base else f"{'':>7}"
        print(f"{case:<36} {metric:<52} {fmt.format(ours)} {base_s} {ratio} "
              f"{target(case, metric):>8}")
    print("baseline = EPLB-style greedy allocation + packing, identity node mapping; "
          "'...lost nodes held' compares our moves with what the lost nodes held; 'local "
          "search' rows compare the most fragile layer's structure searched (lazarus column) "
          "with the construction alone (baseline column).")


if __name__ == "__main__":
    main()
