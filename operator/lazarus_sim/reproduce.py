"""The paper reproduction: `lazarus simulate --reproduce DIR` writes DIR/README.md and figures.

Every number in the report is computed here, on our solver and simulator, beside the number
the paper reports (paper-notes.md). The prose that explains the differences is fixed text;
the numbers it refers to are filled in from the runs.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from lazarus_core.solver import plan_job, replan
from . import config, plots, scenario, sweeps
from .progress import Progress
from .scenario import samples_ratio
from .strategies import TITLES, feasible_min_replicas
from .table import times
from .throughput import expert_parallel_imbalance, lazarus_imbalance, step_seconds
from .trace import read_availability
from .workload import PRESETS, Costs

SEEDS = 8
DURATION_S = 4800  # 80 minutes, the length of the paper's spot-trace run
REPLACE_S = 120  # a replacement spot VM boots and joins two minutes after a loss
SPOT = {"kind": "availability", "path": "aws-g4dn", "start_s": 21600.0, "scale_to": 10,
        "duration_s": float(DURATION_S)}
# Windows of both AWS traces, one every WINDOW_EVERY_S, to show how much the ratios vary
# with the stretch of trace (the paper shows one).
SPOT_TRACES = ("aws-g4dn", "aws-p2")
WINDOW_EVERY_S = 7200
WINDOW_SEEDS = 3
SKEW_RATIOS = [1, 1.5, 2, 2.5, 3, 3.5, 4]
RECONFIG_DRAWS = 20  # random failure sets per Table 2 row

# Paper numbers (paper-notes.md), keyed like our rows. None: the paper gives no number.
PAPER_MTBF = {  # (model, mtbf_s) -> (vs DeepSpeed, vs DS(FT))
    ("gpt-s", 300): (2.8, 1.4), ("gpt-l", 300): (5.7, 2.8),
    ("gpt-s", 2400): (1.6, None), ("gpt-l", 2400): (2.3, None),
}
PAPER_SPOT = {"gpt-s": (2.3, 1.2), "gpt-l": (3.4, 1.8)}
PAPER_RECOVERY_K4 = {"mro": 0.41, "spread": 0.12, "compact": 0.0}
PAPER_RECONFIG = [  # model, nodes lost, reconfig s, experts migrated, transfer s (Table 2)
    ("gpt-s", 2, 21.3, 11, 2.3), ("gpt-s", 3, 34.1, 52, 3.0),
    ("gpt-l", 4, 18.2, 160, 7.6), ("gpt-l", 5, 19.7, 55, 7.8),
]
# Our own reconfiguration: the controller sees the loss (no collective timeout to wait out)
# and the runtime regroups in-process (design.md measured 13-30 ms); a second each leaves room
# for the plan's round trip through the API server.
OUR_COSTS = {"detect_s": 1.0, "rebuild_s": 1.0}


def cfg_for(model: str, trace: dict, seeds: int = SEEDS, lazarus: dict | None = None,
            costs: dict | None = None) -> config.SimConfig:
    return config.parse({"model": model, "trace": trace, "seeds": seeds,
                         "strategies": {"lazarus": lazarus or {}}, "costs": costs or {}})


def mtbf_trace(mtbf_s: float, notice_s: float = 0.0) -> dict:
    return {"kind": "mtbf", "mtbf_s": float(mtbf_s), "replace_s": float(REPLACE_S),
            "duration_s": float(DURATION_S), "notice_s": notice_s}


def window_starts(name: str) -> list[float]:
    """Where the spot windows of a trace begin: every WINDOW_EVERY_S while a whole one fits."""
    end = read_availability(name)[0][-1][0]
    return [float(t) for t in range(0, int(end - DURATION_S) + 1, WINDOW_EVERY_S)]


def spot_window(name: str, start: float) -> dict:
    return {"kind": "availability", "path": name, "start_s": start, "scale_to": 10,
            "duration_s": float(DURATION_S)}


@dataclass
class Run:
    cfg: config.SimConfig
    results: dict
    summaries: dict

    def ratio(self, baseline: str) -> float:
        return scenario.ratio(self.summaries, "lazarus", baseline)

    def spread(self, baseline: str) -> str:
        """The mean ratio with its range over the traces."""
        per_trace = [samples_ratio(a.samples, b.samples)
                     for a, b in zip(self.results["lazarus"], self.results[baseline])]
        return (f"{times(self.ratio(baseline))} ({times(min(per_trace))}–"
                f"{times(max(per_trace))})").replace("x", "×")


def simulate(cfg: config.SimConfig, progress: Progress) -> Run:
    results = scenario.run(cfg, progress.tick)
    return Run(cfg, results, scenario.summarise(results))


def write(out: Path, progress: bool = True) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    mtbf_cfgs = {(m, s): cfg_for(m, mtbf_trace(s)) for m in ("gpt-s", "gpt-l")
                 for s in (300, 2400)}
    spot_cfgs = {m: cfg_for(m, SPOT) for m in ("gpt-s", "gpt-l")}
    noticed = {"lazarus": {"use_notices": True}}
    ours_cfgs = {
        "paper costs + 120 s spot notices": cfg_for(
            "gpt-l", mtbf_trace(300, notice_s=120.0), **noticed),
        "our costs": cfg_for("gpt-l", mtbf_trace(300), costs=OUR_COSTS),
        "our costs + 120 s spot notices": cfg_for(
            "gpt-l", mtbf_trace(300, notice_s=120.0), costs=OUR_COSTS, **noticed),
    }
    spot_notice_cfgs = {m: cfg_for(m, {**SPOT, "notice_s": 120.0}, costs=OUR_COSTS, **noticed)
                        for m in ("gpt-s", "gpt-l")}
    window_cfgs = {(m, name, start): cfg_for(m, spot_window(name, start), seeds=WINDOW_SEEDS)
                   for m in ("gpt-s", "gpt-l") for name in SPOT_TRACES
                   for start in window_starts(name)}
    every = [mtbf_cfgs, spot_cfgs, ours_cfgs, spot_notice_cfgs, window_cfgs]
    bar = Progress(sum(3 * c.seeds for cfgs in every for c in cfgs.values()), "reproducing",
                   enabled=progress and sys.stderr.isatty())
    mtbf, spot, ours, spot_notice, windows = ({key: simulate(c, bar) for key, c in cfgs.items()}
                                              for cfgs in every)

    figures = _figures(out, mtbf, spot)
    text = _report(mtbf, spot, ours, spot_notice, windows, figures)
    path = out / "README.md"
    path.write_text(text)
    return path


# --- figures ------------------------------------------------------------------------------

def _first(run: Run) -> dict:
    return {name: runs[0] for name, runs in run.results.items()}


def _figures(out: Path, mtbf: dict, spot: dict) -> dict:
    nodes = sweeps.cluster_nodes(10, 6)
    gpt_l = PRESETS["gpt-l"]
    loads_l = cfg_for("gpt-l", mtbf_trace(300), seeds=1).loads
    recovery = sweeps.recovery_curves(gpt_l, nodes, 2, loads_l, 8)
    skew = {m: sweeps.throughput_vs_skew(PRESETS[m], nodes, 2, SKEW_RATIOS)
            for m in ("gpt-s", "gpt-m", "gpt-l")}
    series = {f"{PRESETS[m].name} {who}": ys for m, s in skew.items() for who, ys in s.items()}
    files = {
        "mtbf": plots.samples_over_time(
            {f"{PRESETS[m].name}, MTBF {s // 60} min (seed 0)": _first(run)
             for (m, s), run in mtbf.items()}, out / "samples_mtbf.png"),
        "spot": plots.samples_over_time(
            {f"{PRESETS[m].name}, AWS g4dn spot trace (seed 0)": _first(run)
             for m, run in spot.items()}, out / "samples_spot.png"),
        "recovery": plots.recovery(recovery, "GPT-L, 10 nodes x 6 slots, f=2",
                                   out / "recovery.png"),
        "skew": plots.throughput_vs_skew(SKEW_RATIOS, series, "no failures, 10 GPUs",
                                         out / "throughput_vs_skew.png"),
        "breakdown": plots.time_breakdown(
            {PRESETS[m].name: run.summaries for m, run in spot.items()},
            out / "time_breakdown_spot.png"),
    }
    return {"files": files, "recovery": recovery, "skew": skew}


# --- the report ---------------------------------------------------------------------------

def _x(value: float | None) -> str:
    return "—" if value is None else times(value).replace("x", "×")


def _pct(value: float) -> str:
    return f"{100 * value:.0f}%"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(r) + " |" for r in rows])


def _reconfig_rows() -> list[list[str]]:
    """Table 2 on our solver: a rebalanced plan loses k random nodes, re-plans and migrates."""
    rows = []
    costs = Costs()
    rng = np.random.default_rng(0)
    nodes = sweeps.cluster_nodes(10, 6)
    for model_name, lost, paper_total, paper_migrated, paper_transfer in PAPER_RECONFIG:
        cfg = cfg_for(model_name, mtbf_trace(300), seeds=1)
        old = plan_job(nodes, cfg.model.experts, cfg.model.layers, 2, "mro", loads=cfg.loads,
                       max_failures=0)
        migrated, transfer, recovered = [], [], 0
        for _ in range(RECONFIG_DRAWS):
            gone = set(rng.choice(len(nodes), lost, replace=False).tolist())
            survivors = [n for i, n in enumerate(nodes) if i not in gone]
            f = feasible_min_replicas(2, survivors, cfg.model.experts)
            # As the simulation re-plans (strategies.Lazarus): without the search for
            # fewer copies.
            step = replan(replace(old, min_replicas=f), survivors, "NodeLost",
                          {n.name for n in survivors}, loads=cfg.loads, max_failures=0,
                          copy_search=False)
            if step.migration.recoverable:
                recovered += 1
                migrated.append(step.migration.experts_migrated)
                transfer.append(costs.migration_s(cfg.model, step.migration))
        mean_transfer = float(np.mean(transfer)) if transfer else float("nan")
        rows.append([f"{cfg.model.name}, {lost} lost", f"{paper_migrated}",
                     f"{np.mean(migrated):.0f}" if migrated else "—", f"{paper_transfer:.1f}",
                     f"{mean_transfer:.1f}", f"{paper_total:.1f}",
                     f"{costs.fixed_reconfiguration_s(lost=True) + mean_transfer:.1f}",
                     f"{recovered}/{RECONFIG_DRAWS}"])
    return rows


def _breakdown_rows(runs: dict) -> list[list[str]]:
    rows = []
    for label, run in runs.items():
        for name, s in run.summaries.items():
            f = s.fractions
            rows.append([label, TITLES[name], _pct(f["compute"]), _pct(f["reconfiguration"]),
                         _pct(f["checkpoint"]), _pct(f["restart"]), _pct(f["waiting"]),
                         _pct(f["lost"])])
    return rows


def _window_rows(windows: dict) -> tuple[list[list[str]], list[list[str]]]:
    """Per window, and summed up per model and trace: Lazarus's ratio to each baseline."""
    rows, summary, ratios = [], [], {}
    for (model, name, start), run in windows.items():
        r = [run.ratio(b) for b in ("checkpoint_restart", "elastic_restart")]
        ratios.setdefault((model, name), []).append(r)
        rows.append([PRESETS[model].name, name, f"{start / 3600:g} h", _x(r[0]), _x(r[1]),
                     _pct(run.summaries["checkpoint_restart"].fractions["waiting"]),
                     _pct(run.summaries["lazarus"].fractions["waiting"])])
    for (model, name), rs in ratios.items():
        cells = []
        for i in range(2):
            known = sorted(x[i] for x in rs if math.isfinite(x[i]))
            cells.append(f"{_x(known[0])} – {_x(known[len(known) // 2])} – {_x(known[-1])}"
                         if known else "—")
        never = sum(1 for x in rs if not math.isfinite(x[0]))
        summary.append([PRESETS[model].name, name, str(len(rs)), *cells, str(never)])
    return rows, summary


def _report(mtbf, spot, ours, spot_notice, windows, figures) -> str:
    files = {k: p.name for k, p in figures["files"].items()}
    costs = Costs()
    nodes = sweeps.cluster_nodes(10, 6)
    m = PRESETS["gpt-m"]
    cfg_m = cfg_for("gpt-m", mtbf_trace(300), seeds=1)
    plan_m = plan_job(nodes, m.experts, m.layers, 2, "mro", loads=cfg_m.loads, max_failures=0)
    laz_m = 40 / step_seconds(m, lazarus_imbalance(plan_m, cfg_m.loads))
    ds_m = 40 / step_seconds(m, expert_parallel_imbalance(cfg_m.loads))

    lines = [
        "# Reproducing the Lazarus paper's results on our solver",
        "",
        "Generated by `lazarus simulate --reproduce docs/reproduction`; do not edit by hand.",
        "Every run uses our placement solver (`lazarus_core.solver`: allocation, MRO, repair",
        "of the surviving structure, migration planning) inside the discrete-event simulator",
        "(`lazarus_sim`). The paper's numbers come from its testbed; ours come from a",
        "model of it whose assumptions are listed at the end. Ratios are samples trained by",
        f"Lazarus over samples trained by the baseline, mean of {SEEDS} traces each.",
        "",
        "## Goodput under failures at a fixed MTBF (paper Fig. 6, 7)",
        "",
        f"Exponential failures over the whole 10-node cluster, {DURATION_S // 60} minutes, a",
        f"replacement node joining {REPLACE_S} s after each loss.",
        "",
    ]
    rows = []
    for (model, mtbf_s), run in mtbf.items():
        paper = PAPER_MTBF[(model, mtbf_s)]
        s = run.summaries
        rows.append([PRESETS[model].name, f"{mtbf_s // 60} min",
                     f"{s['lazarus'].samples:,.0f}", f"{s['checkpoint_restart'].samples:,.0f}",
                     f"{s['elastic_restart'].samples:,.0f}",
                     run.spread("checkpoint_restart"), _x(paper[0]),
                     run.spread("elastic_restart"), _x(paper[1])])
    lines += _table(["model", "MTBF", "Lazarus samples", "DeepSpeed", "DS(FT)",
                     "vs DeepSpeed (range)", "paper", "vs DS(FT) (range)", "paper"], rows)
    lines += ["", f"![samples over time]({files['mtbf']})", ""]

    lines += [
        "## Goodput on a real spot trace (paper Fig. 9)",
        "",
        "The g4dn.xlarge trace in us-east-1c (`aws-spot-g4dn-xlarge-us-east-1c-2020-11-20.csv`,",
        "real AWS measurements published by the Bamboo project, NSDI '23), 80 minutes from",
        "second 21600, its peak of 12 instances scaled to our 10 nodes. Which node a drop",
        "takes is random (the trace has counts only), so the seeds vary the victims.",
        "",
    ]
    rows = []
    for model, run in spot.items():
        paper = PAPER_SPOT[model]
        restores = run.summaries["lazarus"].counts.get("restores", 0)
        rows.append([PRESETS[model].name, run.spread("checkpoint_restart"), _x(paper[0]),
                     run.spread("elastic_restart"), _x(paper[1]), f"{restores:.2g}"])
    lines += _table(["model", "vs DeepSpeed (range)", "paper", "vs DS(FT) (range)", "paper",
                     "Lazarus checkpoint restores per run (paper: 1)"], rows)
    lines += ["", f"![samples over time on the spot trace]({files['spot']})", "",
              "Where the time went on the spot trace (paper Fig. 11: Lazarus under 10% on",
              "reconfiguration; DeepSpeed over half checkpointing and restarting; DS(FT) 27% on",
              "restarts for GPT-L):", ""]
    lines += _table(["model", "strategy", "compute", "reconfiguration", "checkpoint",
                     "restart", "waiting", "lost (redone)"],
                    _breakdown_rows({PRESETS[m].name: run for m, run in spot.items()}))
    lines += ["", f"![time breakdown]({files['breakdown']})", ""]

    rows, summary = _window_rows(windows)
    lines += [
        "## Goodput across windows of both spot traces",
        "",
        f"One window of {DURATION_S // 60} minutes every {WINDOW_EVERY_S // 3600} hours of the",
        "g4dn trace above and of the calmer p2.xlarge trace in us-east-1e",
        "(`aws-spot-p2-xlarge-us-east-1e-2020-11-23.csv`, same source), each scaled to 10",
        f"nodes, {WINDOW_SEEDS} seeds per window. The ratio depends a lot on the window: in a",
        "calm one every strategy trains almost all the time, in a volatile one DeepSpeed waits",
        "for its full world while Lazarus keeps going. Lowest – median – highest over the",
        "windows (a window where DeepSpeed trained nothing has no finite ratio and is counted",
        "apart):",
        "",
    ]
    lines += _table(["model", "trace", "windows", "vs DeepSpeed", "vs DS(FT)",
                     "windows DeepSpeed never ran"], summary)
    lines += ["", "Every window (ratios are the mean of the seeds; waiting is the share of the",
              "window each spent waiting for nodes):", ""]
    lines += _table(["model", "trace", "from", "vs DeepSpeed", "vs DS(FT)", "DeepSpeed waiting",
                     "Lazarus waiting"], rows)
    lines += [""]

    rec = figures["recovery"]
    lines += [
        "## Recovery probability (paper Fig. 8)",
        "",
        "GPT-L, 10 nodes x 6 slots, f = 2, replicas allocated to the skewed loads below; the",
        "probability that the whole model (all 12 layers) survives k random node failures.",
        "",
    ]
    lines += _table(["k failed"] + list(rec) + ["paper at k = 4"],
                    [[str(k)] + [f"{rec[p][k - 1]:.2f}" for p in rec]
                     + (["MRO 0.41, spread 0.12, compact 0"] if k == 4 else [""])
                     for k in range(1, len(rec["mro"]) + 1)])
    lines += ["", f"![recovery]({files['recovery']})", ""]

    skew = figures["skew"]
    lines += [
        "## Throughput under load skew (paper Fig. 10a)",
        "",
        "No failures, 10 GPUs. Expert loads rise geometrically from the coldest to the hottest",
        "expert; the ratio is hottest : coldest. Samples per second:",
        "",
    ]
    header = ["ratio"] + [f"{PRESETS[m].name} {who}" for m in skew for who in skew[m]]
    lines += _table(header, [[f"{r:g}:1"] + [f"{skew[m][who][i]:.1f}" for m in skew
                                              for who in skew[m]]
                             for i, r in enumerate(SKEW_RATIOS)])
    lines += ["", f"Without failures, GPT-M at the default skew: Lazarus {laz_m:.1f} samples/s,",
              f"DeepSpeed {ds_m:.1f} (paper: 45 and 34).", "",
              f"![throughput vs skew]({files['skew']})", ""]

    lines += [
        "## Reconfiguration cost (paper Table 2)",
        "",
        f"Our solver re-planning a rebalanced plan after losing k random nodes ({RECONFIG_DRAWS}",
        "draws; means over the recoverable ones), timed with the cost model",
        f"({costs.detect_s:g} s detection + {costs.rebuild_s:g} s rebuild + the busiest node's",
        f"transfers at {costs.link_gb_per_s:g} GB/s).",
        "The paper's rows are single events at steps 200 and 4000 of real runs.",
        "",
    ]
    lines += _table(["case", "paper migrated", "ours migrated", "paper transfer s",
                     "ours transfer s", "paper total s", "ours total s", "recoverable draws"],
                    _reconfig_rows())

    lines += [
        "",
        "## Beyond the paper: reacting sooner",
        "",
        "The same runs with 120 s spot notices used to migrate off a node before it goes, and",
        f"with our costs: {OUR_COSTS['detect_s']:g} s detection and {OUR_COSTS['rebuild_s']:g} s "
        f"rebuild instead of {costs.detect_s:g} s and {costs.rebuild_s:g} s,",
        "because the controller sees a lost node instead of waiting for a collective timeout and",
        "the runtime regroups in-process.",
        "",
    ]
    cases = {"GPT-L, MTBF 5 min, paper costs": mtbf[("gpt-l", 300)],
             **{f"GPT-L, MTBF 5 min, {label}": run for label, run in ours.items()}}
    for m in spot:
        cases[f"{PRESETS[m].name}, spot trace, paper costs"] = spot[m]
        cases[f"{PRESETS[m].name}, spot trace, our costs + 120 s notices"] = spot_notice[m]
    rows = [[label, _x(run.ratio("checkpoint_restart")), _x(run.ratio("elastic_restart")),
             _pct(run.summaries["lazarus"].fractions["compute"])]
            for label, run in cases.items()]
    lines += _table(["case", "vs DeepSpeed", "vs DS(FT)", "Lazarus time computing"], rows)
    lines += ["", *_WHY.splitlines(), "", *_assumptions(costs).splitlines(), ""]
    return "\n".join(lines)


_WHY = """## Where we differ from the paper, and why

- **Lazarus beats both baselines everywhere, by more at a 5-minute MTBF than at 40, and by
  more for GPT-L than for GPT-S against DeepSpeed**: the paper's direction holds.
- **Against DeepSpeed, GPT-S is close to the paper and GPT-L falls short of it, most of
  all at a 5-minute MTBF.** The DeepSpeed baseline is dominated by two numbers the paper does not
  report: how long a replacement node takes to arrive (we assume 2 minutes) and how long a
  full restart takes (we assume 60 s plus reading the checkpoint back). Any longer wait or
  restart on the paper's testbed widens the gap; GPT-L, with the larger checkpoint, is hit
  hardest, which is the paper's pattern too.
- **Against DS(FT), the paper's GPT-L ratios lie within the range over our traces, and
  GPT-S comes out higher.** Our
  DS(FT) grows back into each replacement node with a second restart right after its next
  checkpoint; the paper does not say when DS(FT) re-admits nodes. With GPT-S's short steps
  that extra restart weighs more than the work it wins back.
- **On the spot trace our DeepSpeed mostly waits rather than restarts.** It needs its full
  10-node world back before it can restart, and this trace seldom holds 10 nodes for long;
  the paper's Fig. 11 books DeepSpeed's lost time as checkpointing and restarting. Either
  way it computes for well under half the run.
- **The window decides most of the spot-trace ratio.** The paper shows one window; over
  windows of both AWS traces the ratio against DeepSpeed runs from about 1.4× in calm
  stretches (no node lost: what is left is Lazarus's balanced ranks against expert
  parallelism's hottest expert, and fewer checkpoints) to about 2.8× in volatile ones,
  where DeepSpeed waits for its full world. The first six hours of the g4dn trace hold no
  instance at all: every strategy waits, and there is no ratio.
- **Checkpoint restores on the spot trace.** Our 80-minute window has several mass drops
  (12 instances to 5, and down to 2), so losing 6 of 10 nodes at once often takes every
  replica of some GPT-L expert; the paper's trace needed one restore. When 2 nodes are
  left, GPT-L's 16 experts do not fit in 12 slots, so Lazarus and DS(FT) both wait.
- **Recovery probability is higher than the paper's for MRO and spread alike.** The paper
  placed replicas from the loads it measured at step 200, which we do not have; we use a
  Zipf skew fitted to its GPT-M throughput result. Stronger skew leaves more experts at the
  minimum of 2 replicas and lowers every curve. The ordering holds: MRO at or above spread
  at every k, compact far below (our MRO scores its candidates by exact recovery and never
  returns one worse than spread or compact).
- **More experts migrate per reconfiguration than in Table 2.** After a loss our solver
  re-allocates replicas to the smaller slot count in every layer, keeps the surviving cores
  and what each node holds where it can, and moves more only to bring the ranks within 5%
  of the mean (on 6 nodes left of 10, keeping everything would leave the busiest rank 70%
  above it); the paper's counts come from its own loads and greedy mapping. For GPT-L the
  transfers then take longer than the paper's 7.6 s: moving fewer experts is the solver's
  lever there, and cutting the fixed rebuild (next section) is the other.
- **Spot notices help while detecting a loss is slow, and cost a little once it is fast.**
  A planned move off a noticed node skips the detection wait and the step in flight, which
  pays with the paper's 12 s of timeouts. But migrating as soon as the notice arrives gives
  up that node's throughput for the rest of the notice period, which outweighs a 1 s
  detection. Notices matter most when a loss would be unrecoverable (mass drops, zone
  outages). Starting the move just in time, one migration's length before the deadline,
  would keep both benefits; the simulator models the simple policy only.
- **With equal loads, GPT-L on Lazarus is slower than DeepSpeed (the 1:1 row).** 60 slots
  cannot give 16 experts equal replica counts (twelve get 4, four get 3). Surviving every
  3-node failure but one needs the four 3-replica experts on one triple of nodes, and then
  those nodes compute at least 4 × 1/3 + 2 × 1/4 = 1.83 experts' worth of tokens against a
  mean of 1.6 (14.6% more) while DeepSpeed is perfectly balanced. Spreading them over two
  triples would balance the ranks and cost a second fatal 3-node set; our solver keeps
  recovery first. The paper does not show this case.
- **Throughput under skew stays flat for Lazarus** because Algorithm 1 fills every replica
  to t_e / r_e (balanced by construction), so the busiest rank's tokens depend only on how
  closely replica counts can follow loads in N·c slots. DeepSpeed's busiest rank computes
  the hottest expert's tokens, so its throughput falls as 1 / (1 − φ + φ·max/mean)."""


def _assumptions(costs: Costs) -> str:
    models = "\n".join(
        f"| {m.name} | {m.experts} | {m.expert_mb:g} MB | {m.state_gb:.1f} GB | {m.step_s:g} s "
        f"| {m.expert_fraction:g} |" for m in PRESETS.values())
    return f"""## Assumptions

| model | experts | per expert (paper) | full state | step at balance | expert share φ |
|---|---|---|---|---|---|
{models}

- Cluster: the paper's 10 GPUs as 10 nodes, c = 6 slots, f = 2, MRO, 4 samples per GPU per
  step. A step's expert share φ waits for the busiest rank:
  step = step_at_balance × (1 − φ + φ × imbalance).
- Step time: the paper's GPT-M runs 45 samples/s on 10 GPUs × 4 samples, 0.89 s a step;
  GPT-S and GPT-L are scaled by active parameters. Full state = expert state from the
  paper's MB per expert + dense parameters × 16 bytes.
- Loads: {config.DEFAULT_LOADS} in every layer, the skew at which our throughput model gives
  the paper's no-failure GPT-M ratio (45 : 34). Lazarus starts from uniform loads and
  rebalances at step 200 (then every 200 steps, when the gain repays the move).
- Checkpoints: DeepSpeed every 50 steps, DS(FT) and Lazarus every 250 (the paper's
  intervals; Lazarus's is not stated, we give it DS(FT)'s). Writing one takes full state /
  {costs.checkpoint_gb_per_s:g} GB/s; reading it back full state / {costs.restore_gb_per_s:g} GB/s.
- Restart (baselines): {costs.restart_s:g} s to relaunch processes and rebuild communicators,
  plus reading the checkpoint. DeepSpeed waits for a full 10-node world; DS(FT) restarts on
  whatever is alive and grows back into new nodes right after its next checkpoint.
- Lazarus reconfiguration: {costs.detect_s:g} s to detect a loss plus {costs.rebuild_s:g} s to
  rebuild (paper Table 2: 20–40 s in total, of which 10–20 s NCCL timeouts and 5–15 s new
  groups, 18 s on average), plus the migration plan's busiest node at
  {costs.link_gb_per_s:g} GB/s (the paper's GPT-L row moved 160 experts, 18 GB, in 7.6 s:
  about 0.4 GB/s per survivor). Growing, rebalancing and moving off a node under notice are
  planned and skip the detection. An unrecoverable loss costs the fixed part plus reading
  the checkpoint, and the steps since it. A failure redoes the step in flight.
- Baselines use standard expert parallelism: the busiest rank computes the hottest
  expert's tokens (a capacity factor that pads to it costs the same; a smaller one drops
  tokens, which changes the model rather than the step time and is not modelled)."""
