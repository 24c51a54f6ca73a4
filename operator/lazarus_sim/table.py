"""The text table `lazarus simulate` prints: samples, goodput ratios and time breakdown."""
from __future__ import annotations

import math

from .config import SimConfig
from .engine import CATEGORIES
from .scenario import Summary, ratio
from .strategies import TITLES

BASELINES = ("checkpoint_restart", "elastic_restart")


def times(ratio: float, digits: int = 1) -> str:
    """A ratio as "2.35x"; "n/a" when neither side trained anything (0/0), "∞" when only
    the baseline did not."""
    if math.isnan(ratio):
        return "n/a"
    if math.isinf(ratio):
        return "∞"
    return f"{ratio:.{digits}f}x"


def render(cfg: SimConfig, summaries: dict[str, Summary], trace_label: str) -> str:
    c = cfg.cluster
    head = (f"{cfg.model.name} on {c['nodes']} nodes x {c['gpus_per_node']} GPU x "
            f"{c['slots_per_gpu']} slots, f={c['min_replicas']}, {c['policy']}; "
            f"trace: {trace_label}" + (f" (+{cfg.seeds - 1} more seeds, averaged)"
                                       if cfg.seeds > 1 else ""))
    cols = ["strategy", "samples"] + [f"vs {TITLES[b]}" for b in BASELINES] + list(CATEGORIES)
    rows = []
    for name, s in summaries.items():
        rows.append([TITLES[name], f"{s.samples:,.0f}"]
                    + [times(ratio(summaries, name, b), 2) for b in BASELINES]
                    + [f"{100 * s.fractions[k]:.1f}%" for k in CATEGORIES])
    widths = [max(len(r[i]) for r in [cols] + rows) for i in range(len(cols))]
    fmt = lambda r: "  ".join(v.ljust(w) if i == 0 else v.rjust(w)  # noqa: E731
                             for i, (v, w) in enumerate(zip(r, widths)))
    events = [f"{TITLES[n]}: " + (", ".join(f"{k} {v:,.4g}" for k, v in s.counts.items())
                                  or "nothing happened")
              for n, s in summaries.items()]
    return "\n".join([head, "", fmt(cols)] + [fmt(r) for r in rows]
                     + ["", "per run (mean): " + "; ".join(events)])
