"""PNG figures in the style of the paper's; matplotlib is imported only here, only when drawing."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .engine import CATEGORIES, Result
from .scenario import Summary
from .strategies import TITLES

_COLORS = {"lazarus": "tab:red", "checkpoint_restart": "tab:blue", "elastic_restart": "tab:green",
           "mro": "tab:red", "spread": "tab:orange", "compact": "tab:gray"}
_CATEGORY_COLORS = dict(zip(CATEGORIES, ("tab:green", "tab:purple", "tab:blue", "tab:orange",
                                         "tab:gray", "tab:red")))


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def samples_over_time(panels: dict[str, dict[str, Result]], path: Path) -> Path:
    """One panel per title: samples trained vs minutes, a line per strategy (Fig. 6/7/9)."""
    plt = _pyplot()
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.6 * rows), squeeze=False)
    for ax, (title, runs) in zip(axes.flat, panels.items()):
        for name, r in runs.items():
            t, s = zip(*r.curve, (r.duration, r.samples))
            ax.plot([x / 60 for x in t], [y / 1000 for y in s], drawstyle="steps-post",
                    label=TITLES[name], color=_COLORS[name])
        ax.set(title=title, xlabel="time (min)", ylabel="samples trained (thousands)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def recovery(curves: dict[str, Sequence[float]], title: str, path: Path) -> Path:
    """Recovery probability vs failed nodes, a line per placement policy (Fig. 8)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for policy, ps in curves.items():
        ax.plot(range(1, len(ps) + 1), ps, marker="o", label=policy, color=_COLORS[policy])
    ax.set(title=title, xlabel="failed nodes", ylabel="recovery probability", ylim=(-0.03, 1.03))
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def throughput_vs_skew(ratios: Sequence[float], series: dict[str, Sequence[float]], title: str,
                       path: Path) -> Path:
    """Samples/s with no failures as the expert load ratio grows, a line per label (Fig. 10a).

    Labels are "<model> <system>": one colour per model; Lazarus solid, the others dashed.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    models = list(dict.fromkeys(label.rsplit(" ", 1)[0] for label in series))
    for label, ys in series.items():
        model, system = label.rsplit(" ", 1) if " " in label else ("", label)
        ax.plot(ratios, ys, marker="o", label=label, color=f"C{models.index(model)}",
                linestyle="-" if system == "Lazarus" else "--")
    ax.set(title=title, xlabel="load ratio, hottest : coldest expert", ylabel="samples / s",
           ylim=(0, None))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def time_breakdown(groups: dict[str, dict[str, Summary]], path: Path) -> Path:
    """Stacked share of time per category, a bar per strategy, grouped (Fig. 11)."""
    plt = _pyplot()
    bars = sum(len(s) for s in groups.values())
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * bars + 2.5), 3.8))
    labels, x = [], 0
    ticks = []
    for group, summaries in groups.items():
        for name, s in summaries.items():
            bottom = 0.0
            for c in CATEGORIES:
                share = 100 * s.fractions[c]
                ax.bar(x, share, bottom=bottom, color=_CATEGORY_COLORS[c],
                       label=c if not labels else None)
                bottom += share
            labels.append(f"{TITLES[name]}\n{group}")
            ticks.append(x)
            x += 1
        x += 0.5
    ax.set_xticks(ticks, labels, fontsize=7)
    ax.set(ylabel="share of time (%)", ylim=(0, 100))
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    return _save(fig, path)
