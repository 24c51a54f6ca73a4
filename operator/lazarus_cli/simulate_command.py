"""`lazarus simulate`: goodput of Lazarus vs checkpoint-restart baselines under failure traces."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lazarus_sim import config, plots, scenario, sweeps, table
from lazarus_sim.progress import Progress

# flag -> (config section, key): flags override the config file, one validation path for both.
_FLAG_FIELDS = {
    "nodes": ("cluster", "nodes"),
    "slots": ("cluster", "slots_per_gpu"),
    "min_replicas": ("cluster", "min_replicas"),
    "policy": ("cluster", "policy"),
    "mtbf": ("trace", "mtbf_s"),
    "replace": ("trace", "replace_s"),
    "duration": ("trace", "duration_s"),
    "notice": ("trace", "notice_s"),
}


def register(sub) -> None:
    p = sub.add_parser("simulate", help="goodput of Lazarus and restart baselines under failures",
                       description=__doc__ + "\n\n" + config.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML or JSON file (see above); flags override it")
    p.add_argument("--model", help="gpt-s, gpt-m or gpt-l (default gpt-l)")
    p.add_argument("--nodes", type=int, help="nodes (default 10)")
    p.add_argument("--slots", type=int, help="expert slots per GPU c (default 6)")
    p.add_argument("--min-replicas", type=int, help="fault-tolerance threshold f (default 2)")
    p.add_argument("--policy", help="placement policy: mro, spread or compact")
    p.add_argument("--loads", help="zipf:S (default zipf:0.4)")
    p.add_argument("--mtbf", type=float, help="exponential failures at this MTBF in seconds")
    p.add_argument("--replace", type=float, help="seconds until a lost node is replaced")
    p.add_argument("--trace", help="a spot trace: aws-g4dn, aws-p2, synthetic-spot, or a CSV path "
                                   "(availability or events format)")
    p.add_argument("--start", type=float, help="replay a trace file from this second")
    p.add_argument("--scale-to", type=int, help="map an availability trace's peak to N nodes")
    p.add_argument("--duration", type=float, help="simulated seconds")
    p.add_argument("--notice", type=float, help="spot notice lead time in seconds")
    p.add_argument("--use-notices", action="store_true", help="Lazarus pre-migrates on notices")
    p.add_argument("--seeds", type=int, help="traces to average over (default 1)")
    p.add_argument("--out", help="write PNG plots into this folder")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--reproduce", metavar="DIR",
                   help="run the paper reproduction and write DIR/README.md with its figures")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.reproduce:
        from lazarus_sim import reproduce
        path = reproduce.write(Path(args.reproduce), progress=not args.no_progress)
        print(f"wrote {path}")
        return 0
    cfg = config.parse(settings_from(args))
    progress = Progress(cfg.seeds * 3, "simulating",
                        enabled=not args.no_progress and sys.stderr.isatty())
    results = scenario.run(cfg, progress.tick)
    summaries = scenario.summarise(results)
    label = results["lazarus"][0].trace
    if args.json:
        print(json.dumps({"trace": label, "seeds": cfg.seeds, "strategies": {
            n: {"samples": s.samples, "time_fractions": s.fractions, "counts": s.counts}
            for n, s in summaries.items()}}, sort_keys=True))
    else:
        print(table.render(cfg, summaries, label))
    if args.out:
        for path in write_plots(cfg, results, summaries, Path(args.out)):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def settings_from(args) -> dict:
    data = config.load_file(args.config) if args.config else {}
    for section in ("cluster", "trace"):
        data[section] = dict(config.mapping(data.get(section, {}), section))
    if args.trace:
        kind = "events" if _looks_like_events(args.trace) else "availability"
        data["trace"] = {"kind": kind, "path": args.trace}
    for flag, value in (("start", args.start), ("scale_to", args.scale_to)):
        if value is not None:
            data["trace"].setdefault("kind", "availability")
            data["trace"][flag if flag != "start" else "start_s"] = value
    for flag, (section, key) in _FLAG_FIELDS.items():
        value = getattr(args, flag)
        if value is not None:
            data[section][key] = value
    if args.model:
        data["model"] = args.model
    if args.loads:
        data["loads"] = args.loads
    if args.seeds is not None:
        data["seeds"] = args.seeds
    if args.use_notices:
        strategies = dict(config.mapping(data.get("strategies", {}), "strategies"))
        strategies["lazarus"] = {**(strategies.get("lazarus") or {}), "use_notices": True}
        data["strategies"] = strategies
    return data


def _looks_like_events(name: str) -> bool:
    from lazarus_sim.trace import resolve
    try:
        with open(resolve(name)) as f:
            return any(line.startswith("time_s,") for line in f.readlines()[:5])
    except OSError as e:
        raise ValueError(f"--trace: cannot read {name}: {e.strerror}") from None


def write_plots(cfg, results, summaries, out: Path) -> list[Path]:
    c = cfg.cluster
    nodes = sweeps.cluster_nodes(c["nodes"], c["slots_per_gpu"], c["gpus_per_node"])
    first = {name: runs[0] for name, runs in results.items()}
    ratios = [1, 1.5, 2, 2.5, 3, 3.5, 4]
    return [
        plots.samples_over_time({first["lazarus"].trace: first}, out / "samples_over_time.png"),
        plots.time_breakdown({cfg.model.name: summaries}, out / "time_breakdown.png"),
        plots.recovery(sweeps.recovery_curves(cfg.model, nodes, c["min_replicas"], cfg.loads,
                                              min(8, len(nodes) - 1)),
                       f"{cfg.model.name}, {len(nodes)} nodes", out / "recovery.png"),
        plots.throughput_vs_skew(ratios, {
            f"{cfg.model.name} {system}": ys for system, ys in sweeps.throughput_vs_skew(
                cfg.model, nodes, c["min_replicas"], ratios).items()},
            f"no failures, {len(nodes)} nodes", out / "throughput_vs_skew.png"),
    ]
