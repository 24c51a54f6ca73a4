"""Any window of any shipped trace: the simulator runs every strategy to the end, accounts
for every second, and no strategy trains a model its nodes cannot hold."""
from hypothesis import given, settings
from hypothesis import strategies as st

from lazarus_sim import config, scenario
from lazarus_sim.engine import CATEGORIES
from lazarus_sim.trace import SHIPPED, read_availability, read_events

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


@settings(max_examples=40, deadline=None)
@given(windows())
def test_every_window_of_every_shipped_trace_runs_and_accounts_for_every_second(data):
    cfg = config.parse(data)
    results = scenario.run(cfg)
    duration = data["trace"]["duration_s"]
    slots = cfg.cluster["slots_per_gpu"] * cfg.cluster["gpus_per_node"]
    fits = cfg.cluster["nodes"] * slots >= cfg.model.experts
    for name, (r,) in results.items():
        assert abs(sum(r.seconds.values()) - duration) < 1e-6 * max(1.0, duration), name
        assert all(r.seconds[c] >= -1e-6 for c in CATEGORIES), (name, r.seconds)
        assert r.samples >= 0 and r.samples == r.curve[-1][1]
        if not fits:  # the whole job's nodes cannot hold the model: nobody trains
            assert r.samples == 0 and r.seconds["compute"] == 0, name
