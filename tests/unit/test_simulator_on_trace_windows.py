"""Any window of any shipped trace: the simulator runs every strategy to the end, accounts
for every second, and no strategy trains a model its nodes cannot hold; a job whose nodes
never could is refused before it runs."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lazarus_sim import config, scenario
from lazarus_sim.engine import CATEGORIES
from lazarus_sim.trace import SHIPPED, Trace, read_availability, read_events
from lazarus_sim.workload import PRESETS

AVAILABILITY = [name for name in SHIPPED if name.startswith("aws-")]
EVENTS = [name for name in SHIPPED if name not in AVAILABILITY]


def _end(name: str) -> float:
    if name in AVAILABILITY:
        return read_availability(name)[0][-1][0]
    return read_events(name).duration


@st.composite
def windows(draw):
    name = draw(st.sampled_from(sorted(SHIPPED)))
    end = _end(name)
    start = draw(st.floats(0, end - 1, allow_nan=False))
    duration = draw(st.floats(1, min(4 * 3600, end - start), allow_nan=False))
    trace = {"kind": "availability" if name in AVAILABILITY else "events", "path": name,
             "start_s": start, "duration_s": duration}
    if name in AVAILABILITY:
        trace["scale_to"] = draw(st.integers(0, 16))  # 0: the trace's own counts
        trace["notice_s"] = draw(st.sampled_from([0.0, 120.0]))
    return {
        "model": draw(st.sampled_from(["gpt-s", "gpt-l"])),
        "cluster": {"nodes": draw(st.integers(1, 12)), "slots_per_gpu": draw(st.integers(1, 6))},
        "trace": trace,
        "seeds": 1,
        "strategies": {"lazarus": {"use_notices": draw(st.booleans())}},
    }


def _most_at_once(trace: Trace) -> int:
    """The most nodes the trace holds at once (joins count first at equal times, so this
    may count one too many, never too few)."""
    alive: set[str] = set()
    most = 0
    for e in trace.events:
        if e.kind == "join":
            alive.add(e.node)
        elif e.kind == "lose":
            alive.discard(e.node)
        most = max(most, len(alive))
    return most


@settings(max_examples=40, deadline=None)
@given(windows())
def test_every_window_of_every_shipped_trace_runs_and_accounts_for_every_second(data):
    slots = data["cluster"]["slots_per_gpu"]  # one GPU a node
    job = min(data["cluster"]["nodes"], data["trace"].get("scale_to") or math.inf)
    if job * slots < PRESETS[data["model"]].experts:
        # The job's nodes, or the trace scaled to fewer, can never hold the model.
        field = "trace.scale_to" if job < data["cluster"]["nodes"] else "cluster.nodes"
        with pytest.raises(ValueError, match=f"^{field}: .* so nothing would ever train"):
            config.parse(data)
        return
    cfg = config.parse(data)
    results = scenario.run(cfg)
    (trace,) = cfg.traces()
    duration = data["trace"]["duration_s"]
    fits = min(cfg.cluster["nodes"], _most_at_once(trace)) * slots >= cfg.model.experts
    for name, (r,) in results.items():
        assert abs(sum(r.seconds.values()) - duration) < 1e-6 * max(1.0, duration), name
        assert all(r.seconds[c] >= -1e-6 for c in CATEGORIES), (name, r.seconds)
        assert r.samples >= 0 and r.samples == r.curve[-1][1]
        if not fits:  # the window never holds the model: nobody trains
            assert r.samples == 0 and r.seconds["compute"] == 0, name
