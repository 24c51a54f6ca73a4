"""Balance and recovery over 108 small-cluster settings the solver benchmark does not cover.

    hack/bench.sh benchmarks/bench_balance_sweep.py [--detail]

N = 8, 12, 16, 24 nodes of one GPU; c = 4, 6, 8 slots; E = 1.5c, 2c and 4c experts where
f = 2 fits; zipf 0.5, 1 and 1.5 over 4 layers whose hot expert rotates. Each setting is
planned by our solver and by two baselines:

- the paper's MRO (and this solver before issue 18): the popularity grouping, or spread,
  that recovers best on the most fragile layer and no worse than spread and compact,
  nested on every layer, with the allocation formula's counts;
- an EPLB-style greedy (bench_solver.py): replicas to the expert with the most load per
  replica, packed heaviest first onto the least loaded node. It ignores recovery.

Balance is the worst layer's busiest rank over the mean (Algorithm 1 gives each replica
t_e / r_e); recovery the whole model's probability of surviving k random node losses. In
E = N*c/2 settings every expert has exactly f = 2 replicas, so no placement can move load
between them: those are counted apart.
"""
from __future__ import annotations

import argparse
import statistics
import time

from bench_solver import eplb_layout
from lazarus_core.balance import busiest_rank
from lazarus_core.anchor_search import _group_sizes, scored_failures
from lazarus_core.placement import Grouping, compact, nested_groups, spread
from lazarus_core.recovery import fatal_counts, recovery_probability
from lazarus_core.solver import _positions, build_plan, plan_job
from lazarus_core.topology import NodeSpec

TARGET = 1.05
MIN_REPLICAS = 2
LAYERS = 4
FAILURES = (1, 2, 3, 4)


def settings():
    for n in (8, 12, 16, 24):
        for c in (4, 6, 8):
            for experts in (int(1.5 * c), 2 * c, 4 * c):
                if MIN_REPLICAS * experts > n * c:
                    continue
                for skew in (0.5, 1.0, 1.5):
                    yield n, c, experts, skew


def loads(experts: int, skew: float) -> list[list[float]]:
    return [[1 / (((e + l) % experts) + 1) ** skew for e in range(experts)]
            for l in range(LAYERS)]


def recovery(plan) -> list[float]:
    layers = [[list(s) for s in layer.placement] for layer in plan.layers]
    return [recovery_probability(layers, k).probability for k in FAILURES]


def papers_mro(nodes, lo, experts):
    """The paper's MRO: the grouping (or spread) best on the most fragile layer, no worse
    than spread and compact there, nested on every layer."""
    ordered, replicas = _positions(nodes, experts, LAYERS, MIN_REPLICAS, lo)
    slots = [n.slots for n in ordered]
    n, k = len(slots), scored_failures(len(slots))
    probe = min(replicas, key=sorted)

    def key(placement):
        masks = {sum(1 << i for i, held in enumerate(placement) if e in held)
                 for e in range(experts)}
        return tuple(fatal_counts(masks, n, k))

    if experts <= min(slots):
        groupings = [Grouping.build(replicas, slots, [experts])]
    else:
        groupings = [Grouping.build(replicas, slots, sizes, nested)
                     for sizes in _group_sizes(experts, min(slots), n) if len(sizes) <= n
                     for nested in sorted({1, 2, len(sizes) - 1, len(sizes)})
                     if 1 <= nested <= len(sizes)]
    candidates = [(key(nested_groups(probe, slots, g)), 1, g) for g in groupings]
    if experts > min(slots):
        spread_key = key(spread(probe, slots))
        floor = [min(a, b) for a, b in zip(spread_key, key(compact(probe, slots)))]
        candidates.append((spread_key, 0, None))
        candidates = [c for c in candidates
                      if all(a <= b for a, b in zip(c[0], floor))] or candidates
    best = min(candidates, key=lambda c: (c[0], -c[1]))[2]
    placements = [spread(r, slots) if best is None else nested_groups(r, slots, best)
                  for r in replicas]
    return build_plan(ordered, replicas, placements, experts, MIN_REPLICAS, "mro", 1,
                      "Initial", 0)


def eplb(nodes, lo, experts):
    replicas, placements = eplb_layout(nodes, lo, MIN_REPLICAS)
    return build_plan(nodes, replicas, placements, experts, MIN_REPLICAS, "eplb", 1,
                      "Initial", 0)


def worse_somewhere(ours, theirs) -> bool:
    return any(a < b - 1e-9 for a, b in zip(ours, theirs))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--detail", action="store_true", help="one line per setting")
    args = parser.parse_args()
    rows, seconds = [], []
    for n, c, experts, skew in settings():
        nodes = [NodeSpec(f"node-{i:02d}", 1, c) for i in range(n)]
        lo = loads(experts, skew)
        start = time.process_time()
        ours = plan_job(nodes, experts, LAYERS, MIN_REPLICAS, "mro", lo, max_failures=0)
        seconds.append(time.process_time() - start)
        plans = {"lazarus": ours, "paper's MRO": papers_mro(nodes, lo, experts),
                 "EPLB-style": eplb(nodes, lo, experts)}
        row = {name: (busiest_rank(p, lo), recovery(p)) for name, p in plans.items()}
        rows.append(((n, c, experts, skew), row))
        if args.detail:
            print(f"N={n:<2} c={c} E={experts:<2} zipf {skew}: " + "; ".join(
                f"{name} {b:.3f} [{', '.join(f'{r:.3f}' for r in rec)}]"
                for name, (b, rec) in row.items()))
    forced = [r for (n, c, e, _), r in rows if MIN_REPLICAS * e == n * c]
    free = [r for (n, c, e, _), r in rows if MIN_REPLICAS * e < n * c]
    names = ["lazarus", "paper's MRO", "EPLB-style"]
    print(f"{len(rows)} settings ({len(forced)} with every expert at exactly f = 2 replicas, "
          "where no placement moves load)")
    print(f"{'metric':<56} " + " ".join(f"{n:>12}" for n in names)
          + f" {'vs paper':>9} {'vs EPLB':>8}")

    def line(metric, values, fmt="{:>12.3f}"):
        ratios = [f"{values[0] / b:>9.2f}" if b else f"{'':>9}" for b in values[1:]]
        print(f"{metric:<56} " + " ".join(fmt.format(v) for v in values)
              + f" {ratios[0]} {ratios[1][1:]}")

    line(f"settings with the busiest rank over {TARGET} x the mean",
         [sum(r[name][0] > TARGET + 1e-9 for _, r in rows) for name in names], "{:>12d}")
    line("  ...of those where the counts leave room",
         [sum(r[name][0] > TARGET + 1e-9 for r in free) for name in names], "{:>12d}")
    line("median busiest rank / mean",
         [statistics.median(r[name][0] for _, r in rows) for name in names])
    for i, k in enumerate(FAILURES):
        line(f"median recovery, {k} node(s) lost",
             [statistics.median(r[name][1][i] for _, r in rows) for name in names])
    for name in names[1:]:
        worse = sum(worse_somewhere(r["lazarus"][1], r[name][1]) for _, r in rows)
        print(f"settings where lazarus recovers worse than {name} at some k = 1..4: {worse}")
    print(f"lazarus plan time: median {statistics.median(seconds) * 1000:.0f} ms, "
          f"most {max(seconds) * 1000:.0f} ms (CPU, one core)")


if __name__ == "__main__":
    main()
