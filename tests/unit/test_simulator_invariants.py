"""Any trace, any strategy: the ledger accounts for every second and progress stays sane."""
from hypothesis import given, settings
from hypothesis import strategies as st

from lazarus_sim.engine import CATEGORIES
from lazarus_sim.strategies import CheckpointRestart, ElasticRestart, Lazarus
from lazarus_sim.trace import Event, make_trace
from lazarus_sim.workload import Costs, ModelSpec
from lazarus_core.topology import NodeSpec

MODEL = ModelSpec("toy", experts=4, layers=2, expert_mb=100, dense_gb=0.5, step_s=0.5)
COSTS = Costs(restart_s=5.0, rebuild_s=1.0)
NODE = NodeSpec("template", 1, 2)
LOADS = [[4.0, 2.0, 1.0, 1.0]] * 2

happenings = st.lists(st.tuples(st.floats(0.1, 300.0),
                                st.sampled_from(["lose", "join", "notice"]),
                                st.integers(0, 7)), max_size=25)


def build(events):
    joins = [Event(0.0, "join", f"node-{i}", f"zone-{i % 2}") for i in range(4)]
    rest = [Event(round(t, 2), kind, f"node-{n}", f"zone-{n % 2}") for t, kind, n in events]
    return make_trace("fuzz", joins + rest, 300.0)


def jobs():
    yield CheckpointRestart(MODEL, COSTS, 7, NODE, 4, LOADS)
    yield ElasticRestart(MODEL, COSTS, 7, NODE, 4, LOADS)
    for notices in (False, True):
        yield Lazarus(MODEL, COSTS, 7, NODE, 4, LOADS, min_replicas=2, rebalance_every=5,
                      use_notices=notices)


@settings(max_examples=30, deadline=None)
@given(happenings)
def test_every_second_is_accounted_for_and_progress_is_consistent(events):
    trace = build(events)
    for job in jobs():
        r = job.run(trace)
        assert abs(sum(r.seconds.values()) - 300.0) < 1e-6
        assert all(r.seconds[c] >= -1e-9 for c in CATEGORIES)
        times = [t for t, _ in r.curve]
        assert times == sorted(times) and times[-1] <= 300.0
        assert r.samples == r.curve[-1][1] and r.samples >= 0
        # Without a checkpoint restore, Lazarus never loses a trained sample.
        if r.counts.get("restores", 0) == 0 and job.name == "lazarus":
            assert [s for _, s in r.curve] == sorted(s for _, s in r.curve)
