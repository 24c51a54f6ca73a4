"""A simulation's configuration: parsed from a YAML/JSON mapping, every error naming its field.

    model: gpt-l                     # a preset, or {preset: gpt-l, step_s: 1.2, ...}
    cluster: {nodes: 10, gpus_per_node: 1, slots_per_gpu: 6, min_replicas: 2, policy: mro}
    loads: zipf:0.4                  # or per-expert loads, or one list per layer
    trace: {kind: mtbf, mtbf_s: 300, replace_s: 120, duration_s: 4800, notice_s: 0}
    seeds: 3                         # traces per run (seeds 0..n-1); results are averaged
    costs: {detect_s: 12, rebuild_s: 6, restart_s: 60, ...}
    strategies:
      lazarus: {checkpoint_every: 250, rebalance_every: 200, use_notices: false}
      checkpoint_restart: {checkpoint_every: 50}
      elastic_restart: {checkpoint_every: 250}

Trace kinds: ``mtbf`` (mtbf_s, replace_s, notice_s, zones), ``availability`` (path or a
shipped name, start_s, scale_to, notice_s), ``events`` (path or a shipped name, start_s),
``zones`` (zones, nodes_per_zone, node_mtbf_s, zone_mtbf_s, outage_s, replace_s, notice_s).
All take duration_s (0 for availability and events: to the end of the file).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from lazarus_core.job_spec import LIMITS as SPEC_LIMITS
from lazarus_core.plan import POLICIES
from lazarus_core.loads import LOADS_RULE, as_layers, parse_loads
from lazarus_core.solver import LIMITS, check_size
from .settings import checked, mapping, override
from .strategies import STRATEGIES
from .trace import (Trace, exponential, from_availability, read_availability, read_events,
                    window, zone_correlated)
from .workload import PRESETS, Costs, ModelSpec

# Skew that reproduces the paper's no-failure GPT-M result (45 vs 34 samples/s): the hottest
# of 12 experts gets 2.7x the coldest's tokens.
DEFAULT_LOADS = "zipf:0.4"
_TRACE_FIELDS = {
    "mtbf": {"mtbf_s": 300.0, "replace_s": 120.0, "notice_s": 0.0, "zones": 1,
             "duration_s": 4800.0},
    "availability": {"path": "aws-g4dn", "start_s": 0.0, "scale_to": 0, "notice_s": 0.0,
                     "duration_s": 0.0},
    "events": {"path": "synthetic-spot", "start_s": 0.0, "duration_s": 0.0},
    "zones": {"zones": 2, "nodes_per_zone": 5, "node_mtbf_s": 1800.0, "zone_mtbf_s": 3600.0,
              "outage_s": 600.0, "replace_s": 120.0, "notice_s": 0.0, "duration_s": 4800.0},
}
# Losses a generated trace may draw in expectation. The shipped spot traces hold hundreds;
# three strategies replayed 8,571 (gpt-s, 5,000 s, MTBF 0.5 s) in 151 s on one core, so
# this is about half an hour.
MAX_EXPECTED_LOSSES = 100_000
# Traces a run averages over: the standard error of a mean of 1,000 is 3% of one trace's
# spread, finer than the two digits the table prints; 10^6 seeds ran for hours.
MAX_SEEDS = 1_000
# The cluster stands for a LazarusJob's nodes: its fields are bounded as the spec's are.
_SPEC_FIELDS = {"gpus_per_node": "gpusPerNode", "slots_per_gpu": "slotsPerGpu",
                "min_replicas": "minReplicas"}
_STRATEGY_FIELDS = {
    "lazarus": {"checkpoint_every": 250, "rebalance_every": 200, "use_notices": False},
    "checkpoint_restart": {"checkpoint_every": 50},
    "elastic_restart": {"checkpoint_every": 250},
}
_CLUSTER_FIELDS = {"nodes": 10, "gpus_per_node": 1, "slots_per_gpu": 6, "min_replicas": 2,
                   "policy": "mro"}


@dataclass
class SimConfig:
    model: ModelSpec
    costs: Costs
    cluster: dict
    loads: list[list[float]]
    trace: dict  # kind plus that kind's fields
    seeds: int
    strategies: dict[str, dict]  # strategy -> its settings

    def traces(self) -> list[Trace]:
        return [build_trace(self.trace, self.cluster["nodes"], seed) for seed in range(self.seeds)]


def load_file(path: str) -> dict:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"--config: cannot read {path}: {e.strerror}") from None
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"--config: {path} does not parse: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config: {path} must hold a mapping of settings")
    return data


def parse(data: dict) -> SimConfig:
    known = {"model", "cluster", "loads", "trace", "seeds", "costs", "strategies"}
    for key in data:
        if key not in known:
            raise ValueError(f"{key}: unknown setting; known: {', '.join(sorted(known))}")
    model = _model(data.get("model", "gpt-l"))
    cluster = checked(data.get("cluster", {}), _CLUSTER_FIELDS, "cluster")
    if cluster["nodes"] < 1:
        raise ValueError(f"cluster.nodes: must be >= 1, got {cluster['nodes']}")
    for key, field in _SPEC_FIELDS.items():
        low, high = SPEC_LIMITS[field]
        if not low <= cluster[key] <= high:
            raise ValueError(f"cluster.{key}: must be {low}-{high} (a LazarusJob's "
                             f"spec.{field}), got {cluster[key]}")
    check_size(cluster["nodes"], cluster["gpus_per_node"] * cluster["slots_per_gpu"],
               model.experts, model.layers,
               {"nodes": "cluster.nodes", "slots": "cluster.gpus_per_node x slots_per_gpu",
                "experts": "model.experts", "layers": "model.layers"})
    if cluster["policy"] not in POLICIES:
        raise ValueError(f"cluster.policy: must be one of {', '.join(POLICIES)}, "
                         f"got {cluster['policy']!r}")
    loads = data.get("loads", DEFAULT_LOADS)
    if isinstance(loads, list):
        loads = _loads_from_list(loads, model)
    elif isinstance(loads, str) and loads.startswith("zipf:"):
        loads = parse_loads(loads, model.experts, model.layers)
    else:
        raise ValueError(f"loads: must be zipf:S or a list of {model.experts} loads, got {loads!r}")
    trace = _trace(data.get("trace", {"kind": "mtbf"}))
    _check_fits(model, cluster, trace)
    seeds = data.get("seeds", 1)
    if not isinstance(seeds, int) or isinstance(seeds, bool) or not 1 <= seeds <= MAX_SEEDS:
        raise ValueError(f"seeds: must be an integer from 1 to {MAX_SEEDS:,}, got {seeds!r}")
    expected = _expected_losses(trace)
    if seeds * expected > MAX_EXPECTED_LOSSES:
        raise ValueError(f"seeds: {seeds:,} traces x {expected:,.0f} expected "
                         f"losses each, at most {MAX_EXPECTED_LOSSES:,} in all; lower seeds")
    costs = override(Costs(), mapping(data.get("costs", {}), "costs"), "costs")
    given = mapping(data.get("strategies", {}), "strategies")
    for name in given:
        if name not in STRATEGIES:
            raise ValueError(f"strategies.{name}: unknown strategy; known: {', '.join(STRATEGIES)}")
    strategies = {name: checked(given.get(name) or {}, defaults, f"strategies.{name}")
                  for name, defaults in _STRATEGY_FIELDS.items()}
    for name, settings in strategies.items():
        for key in ("checkpoint_every", "rebalance_every"):
            if key in settings and settings[key] < 1:
                raise ValueError(f"strategies.{name}.{key}: must be >= 1, got {settings[key]}")
    return SimConfig(model, costs, cluster, loads, trace, seeds, strategies)


def _model(spec) -> ModelSpec:
    if isinstance(spec, str):
        spec = {"preset": spec}
    spec = dict(mapping(spec, "model"))
    name = spec.pop("preset", "gpt-l")
    if name not in PRESETS:
        raise ValueError(f"model.preset: must be one of {', '.join(PRESETS)}, got {name!r}")
    model = override(PRESETS[name], spec, "model", may_be_zero=("expert_fraction",))
    if not 0 <= model.expert_fraction <= 1:
        raise ValueError(f"model.expert_fraction: must be in [0, 1], got {model.expert_fraction}")
    return model


def _loads_from_list(loads: list, model: ModelSpec) -> list[list[float]]:
    per_layer = as_layers(loads, model.experts, model.layers)
    if per_layer is None:
        raise ValueError(f"loads: give {model.experts} {LOADS_RULE}, or one such list per "
                         f"layer ({model.layers:,} in all)")
    return per_layer


def _trace(spec) -> dict:
    spec = dict(mapping(spec, "trace"))
    kind = spec.pop("kind", "mtbf")
    if kind not in _TRACE_FIELDS:
        raise ValueError(f"trace.kind: must be one of {', '.join(_TRACE_FIELDS)}, got {kind!r}")
    values = checked(spec, _TRACE_FIELDS[kind], "trace")
    for key, value in values.items():
        if not isinstance(value, (int, float)):
            continue
        # A mean gap of 0 draws losses without end, and a generated cluster needs a node.
        if key in _GAPS and value <= 0:
            raise ValueError(f"trace.{key}: must be > 0, got {value}")
        low = 1 if key in _COUNTS else 0
        if value < low:
            raise ValueError(f"trace.{key}: must be >= {low}, got {value}")
    if values.get("scale_to", 0) > LIMITS["nodes"]:
        raise ValueError(f"trace.scale_to: at most {LIMITS['nodes']:,} nodes (the most the "
                         f"solver is built for), got {values['scale_to']:,}")
    # A generated trace holds every loss it draws: a tiny MTBF over a long window drew
    # billions (4.6 GB in a minute, then still drawing).
    for gap in _GAPS:
        if values.get(gap) and values["duration_s"] / values[gap] > MAX_EXPECTED_LOSSES:
            raise ValueError(
                f"trace.{gap}: duration_s / {gap} = {values['duration_s'] / values[gap]:,.0f} "
                f"expected losses, at most {MAX_EXPECTED_LOSSES:,}; raise {gap} or shorten "
                f"duration_s")
    return {"kind": kind, **values}


_GAPS = ("mtbf_s", "node_mtbf_s", "zone_mtbf_s")  # a generated trace's mean gaps
_COUNTS = ("zones", "nodes_per_zone")


def _most_nodes(trace: dict, nodes: int) -> tuple[str, int]:
    """The most nodes a strategy ever trains on, and the field that sets it: the job's
    size (``cluster.nodes``), or fewer where the trace the configuration generates never
    has that many. A trace file's own counts are not a mistake in the configuration (a
    window of it may hold no instance), so they are not weighed here."""
    most = [("cluster.nodes", nodes)]
    if trace["kind"] == "zones":
        most.append(("trace.zones x trace.nodes_per_zone",
                     trace["zones"] * trace["nodes_per_zone"]))
    if trace["kind"] == "availability" and trace["scale_to"]:
        most.append(("trace.scale_to", trace["scale_to"]))
    return min(most, key=lambda m: m[1])


def _check_fits(model: ModelSpec, cluster: dict, trace: dict) -> None:
    """Refuse a cluster that could never hold the model, not even one replica of each
    expert: every strategy would wait through the whole trace (``Job.fits``)."""
    field, count = _most_nodes(trace, cluster["nodes"])
    per_node = cluster["gpus_per_node"] * cluster["slots_per_gpu"]
    if count * per_node < model.experts:
        raise ValueError(f"{field}: {model.name}'s {model.experts} experts need as many "
                         f"expert slots, and {count:,} node{'s' if count > 1 else ''} of "
                         f"{per_node} hold {count * per_node:,}, so nothing would ever train; "
                         f"raise {field} or cluster.slots_per_gpu")


def _expected_losses(trace: dict) -> float:
    """Losses a generated trace draws in expectation (the most over its kinds of loss);
    0 for a trace file, whose losses are its own."""
    return max((trace["duration_s"] / trace[gap] for gap in _GAPS if trace.get(gap)),
               default=0.0)


def build_trace(spec: dict, nodes: int, seed: int) -> Trace:
    kind = spec["kind"]
    duration = spec["duration_s"] or None
    if kind == "mtbf":
        return exponential(nodes, spec["mtbf_s"], spec["duration_s"], spec["replace_s"], seed,
                           spec["notice_s"], spec["zones"])
    if kind == "availability":
        rows, label = read_availability(spec["path"])
        since = f", from {spec['start_s']:g} s" if spec["start_s"] else ""
        return from_availability(rows, f"{label}{since}, seed {seed}", seed, spec["start_s"],
                                 duration, spec["scale_to"] or None, spec["notice_s"])
    if kind == "events":
        trace = read_events(spec["path"])
        return window(trace, spec["start_s"], duration) if spec["start_s"] or duration else trace
    return zone_correlated(spec["zones"], spec["nodes_per_zone"], spec["node_mtbf_s"],
                           spec["zone_mtbf_s"], spec["outage_s"], spec["replace_s"],
                           spec["duration_s"], seed, spec["notice_s"])

