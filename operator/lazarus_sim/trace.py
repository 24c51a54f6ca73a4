"""Failure traces: when nodes join, get a spot notice, and are lost.

A trace is a list of per-node events; the nodes present at the start are joins at time 0.
Node names are fixed when the trace is built, so every strategy replays exactly the same
losses. Three generators (exponential failures at an MTBF, replay of a spot availability
series, zone-correlated outages) and two CSV formats (see ``traces/README.md``).
"""
from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

EVENT_KINDS = ("join", "notice", "lose")
SHIPPED_DIR = Path(__file__).parent / "traces"
# Short names for the traces in traces/: real AWS measurements and one synthetic trace.
SHIPPED = {
    "aws-g4dn": "aws-spot-g4dn-xlarge-us-east-1c-2020-11-20.csv",
    "aws-p2": "aws-spot-p2-xlarge-us-east-1e-2020-11-23.csv",
    "synthetic-spot": "synthetic-spot-2zones.csv",
}
_BAMBOO = "AWS spot measurements from the Bamboo project (NSDI '23), uclasystem/bamboo doc/data/"


@dataclass(frozen=True)
class Event:
    time: float
    kind: str  # one of EVENT_KINDS
    node: str
    zone: str = ""


@dataclass(frozen=True)
class Trace:
    label: str  # what a result table says it ran on
    events: tuple[Event, ...]  # sorted by time; joins before losses at equal times
    duration: float

    def initial_nodes(self) -> list[Event]:
        return [e for e in self.events if e.time == 0 and e.kind == "join"]


def make_trace(label: str, events: list[Event], duration: float) -> Trace:
    if duration <= 0:
        raise ValueError(f"trace.duration_s: must be > 0, got {duration}")
    for e in events:
        if e.kind not in EVENT_KINDS:
            raise ValueError(f"trace: event kind must be one of {', '.join(EVENT_KINDS)}, "
                             f"got {e.kind!r}")
        if e.time < 0:
            raise ValueError(f"trace: event times must be >= 0, got {e.time}")
    order = {k: i for i, k in enumerate(EVENT_KINDS)}
    kept = sorted((e for e in events if e.time < duration), key=lambda e: (e.time, order[e.kind]))
    return Trace(label, tuple(kept), float(duration))


def _zone(i: int, zones: int) -> str:
    return f"zone-{i % zones}" if zones > 1 else ""


def exponential(nodes: int, mtbf_s: float, duration_s: float, replace_s: float,
                seed: int = 0, notice_s: float = 0.0, zones: int = 1) -> Trace:
    """Node losses as a Poisson process with mean gap ``mtbf_s`` over the whole cluster.

    The victim is a uniformly random live node; a new node (a fresh name, same zone) joins
    ``replace_s`` later, as a replacement spot instance would. With ``notice_s`` each loss
    is announced that long before it happens. Nodes are dealt round-robin over ``zones``.
    """
    if nodes < 1:
        raise ValueError(f"cluster.nodes: must be >= 1, got {nodes}")
    events = _generate([_zone(i, zones) for i in range(nodes)], mtbf_s, None, 0.0, replace_s,
                       duration_s, seed, notice_s)
    return make_trace(f"exponential MTBF {mtbf_s:g} s, seed {seed}", events, duration_s)


def zone_correlated(zones: int, nodes_per_zone: int, node_mtbf_s: float, zone_mtbf_s: float,
                    outage_s: float, replace_s: float, duration_s: float, seed: int = 0,
                    notice_s: float = 0.0) -> Trace:
    """Independent node losses plus whole-zone outages (a spot pool reclaimed at once).

    Node losses are as in ``exponential``; on top, each zone has outages at mean gap
    ``zone_mtbf_s`` that take every live node of the zone, and as many new nodes join the
    zone ``outage_s`` later.
    """
    if zones < 1 or nodes_per_zone < 1:
        raise ValueError("trace.zones and trace.nodes_per_zone: must be >= 1")
    if zone_mtbf_s <= 0:
        raise ValueError(f"trace.zone_mtbf_s: must be > 0, got {zone_mtbf_s}")
    events = _generate([f"zone-{i % zones}" for i in range(zones * nodes_per_zone)],
                       node_mtbf_s, zone_mtbf_s, outage_s, replace_s, duration_s, seed, notice_s)
    return make_trace(f"{zones} zones, node MTBF {node_mtbf_s:g} s, zone MTBF "
                      f"{zone_mtbf_s:g} s, seed {seed}", events, duration_s)


def _generate(zone_of: list[str], node_mtbf_s: float, zone_mtbf_s: float | None,
              outage_s: float, replace_s: float, duration_s: float, seed: int,
              notice_s: float) -> list[Event]:
    """Both generators: node losses and (optionally) zone outages, replayed in time order."""
    if node_mtbf_s <= 0:
        raise ValueError(f"trace.mtbf_s: must be > 0, got {node_mtbf_s}")
    if replace_s < 0 or outage_s < 0:
        raise ValueError("trace.replace_s and trace.outage_s: must be >= 0")
    rng = np.random.default_rng(seed)
    happenings = [(t, None) for t in _poisson(rng, node_mtbf_s, duration_s)]
    if zone_mtbf_s is not None:
        for zone in sorted(set(zone_of)):
            happenings += [(t, zone) for t in _poisson(rng, zone_mtbf_s, duration_s)]
    happenings.sort(key=lambda h: h[0])

    events = [Event(0.0, "join", f"node-{i}", z) for i, z in enumerate(zone_of)]
    alive = {e.node: e.zone for e in events}
    joins: list[tuple[float, str]] = []  # (time, zone) of nodes still to arrive
    fresh = len(zone_of)

    def arrive(until: float) -> None:
        nonlocal fresh
        for when, zone in sorted(j for j in joins if j[0] <= until):
            events.append(Event(when, "join", f"node-{fresh}", zone))
            alive[f"node-{fresh}"] = zone
            fresh += 1
        joins[:] = [j for j in joins if j[0] > until]

    for t, zone in happenings:
        arrive(t)
        if zone is None:
            victims = [sorted(alive)[int(rng.integers(len(alive)))]] if alive else []
            back = replace_s
        else:
            victims = sorted(n for n, z in alive.items() if z == zone)
            back = outage_s
        for node in victims:
            events += _loss(t, node, alive.pop(node), notice_s)
            joins.append((t + back, events[-1].zone))
    arrive(duration_s)
    return events


def _poisson(rng: np.random.Generator, mean_gap: float, duration: float) -> list[float]:
    times, t = [], float(rng.exponential(mean_gap))
    while t < duration:
        times.append(t)
        t += float(rng.exponential(mean_gap))
    return times


def _loss(t: float, node: str, zone: str, notice_s: float) -> list[Event]:
    notice = [Event(t - notice_s, "notice", node, zone)] if notice_s > 0 and t >= notice_s else []
    return notice + [Event(t, "lose", node, zone)]


def from_availability(rows: list[tuple[float, int]], label: str, seed: int = 0,
                      start_s: float = 0.0, duration_s: float | None = None,
                      scale_to: int | None = None, notice_s: float = 0.0) -> Trace:
    """Replay a spot availability series: drops lose random live nodes, rises add new ones.

    ``scale_to`` maps the series' peak onto that many nodes (rounding half up), so a trace
    taken on 12 instances can drive a 10-node job. The window [start_s, start_s +
    duration_s) is shifted to begin at 0.
    """
    if not rows:
        raise ValueError(f"trace: {label} has no rows")
    peak = max(c for _, c in rows)
    if peak < 1:
        raise ValueError(f"trace: {label} never has an instance available")
    if duration_s is None:
        duration_s = rows[-1][0] - start_s
    if duration_s <= 0:
        raise ValueError(f"trace.duration_s: the window after start_s={start_s:g} is empty")

    def scaled(c):
        # Half up (6 of 12 scaled to 5 is 2.5 -> 3), not Python's round-half-to-even,
        # which would round 2.5 down and 3.5 up.
        return c if scale_to is None else math.floor(c * scale_to / peak + 0.5)

    rng = np.random.default_rng(seed)
    at_start = scaled(_count_at(rows, start_s))
    events = [Event(0.0, "join", f"node-{i}") for i in range(at_start)]
    alive = [e.node for e in events]
    fresh = at_start
    for t, c in rows:
        if not start_s < t < start_s + duration_s:
            continue
        want = scaled(c)
        when = t - start_s
        while len(alive) < want:
            events.append(Event(when, "join", f"node-{fresh}"))
            alive.append(f"node-{fresh}")
            fresh += 1
        while len(alive) > want:
            victim = alive.pop(int(rng.integers(len(alive))))
            events += _loss(when, victim, "", notice_s)
    return make_trace(label, events, duration_s)


def window(trace: Trace, start_s: float, duration_s: float | None = None) -> Trace:
    """The part of an events trace from ``start_s`` on, shifted to begin at 0: the nodes
    alive at ``start_s`` join at 0, and one already under a spot notice gets it at 0."""
    if not 0 <= start_s < trace.duration:
        raise ValueError(f"trace.start_s: must be in [0, {trace.duration:g}), got {start_s:g}")
    if duration_s is None:
        duration_s = trace.duration - start_s
    alive: dict[str, str] = {}
    noticed: set[str] = set()
    later = []
    for e in trace.events:
        if e.time >= start_s:
            later.append(Event(e.time - start_s, e.kind, e.node, e.zone))
        elif e.kind == "join":
            alive[e.node] = e.zone
        elif e.kind == "lose":
            alive.pop(e.node, None)
            noticed.discard(e.node)
        else:
            noticed.add(e.node)
    first = [Event(0.0, "join", node, zone) for node, zone in alive.items()]
    first += [Event(0.0, "notice", node, alive[node]) for node in sorted(noticed & set(alive))]
    label = trace.label + (f", from {start_s:g} s" if start_s else "")
    return make_trace(label, first + later, duration_s)


def _count_at(rows: list[tuple[float, int]], t: float) -> int:
    """The count in force at time t: the last row at or before it."""
    count = rows[0][1]
    for when, c in rows:
        if when > t:
            break
        count = c
    return count


# --- files ------------------------------------------------------------------------------

def resolve(path_or_name: str) -> Path:
    """A shipped trace's short name, or a path."""
    if path_or_name in SHIPPED:
        return SHIPPED_DIR / SHIPPED[path_or_name]
    return Path(path_or_name)


def read_availability(path_or_name: str) -> tuple[list[tuple[float, int]], str]:
    """Rows of an availability CSV and a label that names its source."""
    path = resolve(path_or_name)
    rows = []
    for n, line in enumerate(_lines(path), 1):
        parts = line.split(",")
        try:
            if len(parts) != 2:
                raise ValueError
            rows.append((float(parts[0]), int(parts[1])))
        except ValueError:
            raise ValueError(f"trace.path: {path}:{n}: expected 'seconds,count', "
                             f"got {line!r}") from None
    label = f"{path.name} ({_BAMBOO})" if path.name.startswith("aws-spot-") else path.name
    return rows, label


def read_events(path_or_name: str, duration_s: float | None = None) -> Trace:
    """An events CSV; without ``duration_s`` it runs to one second after its last event."""
    path = resolve(path_or_name)
    lines = _lines(path)
    comment = next((l[1:].strip() for l in _raw_lines(path) if l.startswith("#")), "")
    reader = csv.DictReader(io.StringIO("\n".join(lines)))
    if reader.fieldnames != ["time_s", "event", "node", "zone"]:
        raise ValueError(f"trace.path: {path} must start with the header time_s,event,node,zone")
    events = []
    for n, row in enumerate(reader, 2):
        try:
            events.append(Event(float(row["time_s"]), row["event"], row["node"], row["zone"] or ""))
        except (TypeError, ValueError):
            raise ValueError(f"trace.path: {path}: row {n} is not time_s,event,node,zone") from None
    if duration_s is None:
        duration_s = max((e.time for e in events), default=0.0) + 1.0
    label = path.name + (f" ({comment})" if comment else "")
    return make_trace(label, events, duration_s)


def write_events(trace: Trace, comment: str = "") -> str:
    out = io.StringIO()
    if comment:
        out.write(f"# {comment}\n")
    out.write("time_s,event,node,zone\n")
    for e in trace.events:
        out.write(f"{e.time:g},{e.kind},{e.node},{e.zone}\n")
    return out.getvalue()


def _raw_lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"trace.path: cannot read {path}: {e.strerror}") from None


def _lines(path: Path) -> list[str]:
    return [l.strip() for l in _raw_lines(path) if l.strip() and not l.startswith("#")]
