"""Run every strategy on every trace of a configuration, and summarise the runs."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lazarus_core.topology import NodeSpec
from .config import SimConfig
from .engine import CATEGORIES, Job, Result
from .strategies import STRATEGIES, CheckpointRestart, ElasticRestart, Lazarus


def make_job(name: str, cfg: SimConfig) -> Job:
    c = cfg.cluster
    node = NodeSpec("template", c["gpus_per_node"], c["slots_per_gpu"], capacity_type="spot")
    s = cfg.strategies[name]
    if name == "lazarus":
        return Lazarus(cfg.model, cfg.costs, s["checkpoint_every"], node, c["nodes"], cfg.loads,
                       c["min_replicas"], c["policy"], s["rebalance_every"], s["use_notices"])
    cls = CheckpointRestart if name == "checkpoint_restart" else ElasticRestart
    return cls(cfg.model, cfg.costs, s["checkpoint_every"], node, c["nodes"], cfg.loads)


def run(cfg: SimConfig, tick: Callable[[], None] = lambda: None) -> dict[str, list[Result]]:
    """strategy -> one result per trace seed; ``tick`` is called after each run."""
    results: dict[str, list[Result]] = {name: [] for name in STRATEGIES}
    for trace in cfg.traces():
        for name in STRATEGIES:
            results[name].append(make_job(name, cfg).run(trace))
            tick()
    return results


@dataclass(frozen=True)
class Summary:
    strategy: str
    samples: float  # mean over seeds
    fractions: dict[str, float]  # category -> mean share of the run's time
    counts: dict[str, float]  # mean per run


def summarise(results: dict[str, list[Result]]) -> dict[str, Summary]:
    out = {}
    for name, runs in results.items():
        n = len(runs)
        keys = sorted({k for r in runs for k in r.counts})
        out[name] = Summary(
            name,
            sum(r.samples for r in runs) / n,
            {c: sum(r.seconds[c] / r.duration for r in runs) / n for c in CATEGORIES},
            {k: sum(r.counts[k] for r in runs) / n for k in keys},
        )
    return out


def ratio(summaries: dict[str, Summary], name: str, baseline: str) -> float:
    """Samples of ``name`` over the baseline's: inf when only the baseline trained nothing,
    nan when neither did (``table.times`` prints both)."""
    return samples_ratio(summaries[name].samples, summaries[baseline].samples)


def samples_ratio(ours: float, base: float) -> float:
    if base:
        return ours / base
    return float("inf") if ours else float("nan")
