"""Failure traces: generators, the shipped real and synthetic traces, the two CSV formats."""
import pytest

from lazarus_sim import trace as tr


def alive_over_time(t: tr.Trace) -> list[tuple[float, int]]:
    alive, out = set(), []
    for e in t.events:
        if e.kind == "join":
            alive.add(e.node)
        elif e.kind == "lose":
            alive.discard(e.node)
        out.append((e.time, len(alive)))
    return out


def test_availability_replay_follows_the_counts_scaled_to_the_cluster():
    rows = [(0, 12), (100, 12), (100, 6), (200, 6), (200, 12), (300, 12), (300, 3)]
    t = tr.from_availability(rows, "toy", seed=1, scale_to=10, duration_s=400)
    counts = dict(alive_over_time(t))
    # 3 of 12 scaled to 10 nodes is 2.5: half up, 3 (Python's round() would say 2).
    assert counts[0.0] == 10 and counts[100.0] == 5 and counts[200.0] == 10 and counts[300.0] == 3
    lost = [e.node for e in t.events if e.kind == "lose"]
    assert len(lost) == len(set(lost)) == 5 + 7  # a lost node never comes back under its name


def test_shipped_aws_traces_load_and_name_their_source():
    for name in ("aws-g4dn", "aws-p2"):
        rows, label = tr.read_availability(name)
        assert rows and "Bamboo" in label
    rows, _ = tr.read_availability("aws-g4dn")
    assert max(c for _, c in rows) == 12 and min(c for _, c in rows) == 0


def test_shipped_synthetic_trace_says_it_is_synthetic():
    t = tr.read_events("synthetic-spot")
    assert "SYNTHETIC" in t.label
    assert len(t.initial_nodes()) == 10
    assert {e.kind for e in t.events} == {"join", "notice", "lose"}


def test_events_csv_round_trips(tmp_path):
    t = tr.exponential(4, mtbf_s=60, duration_s=600, replace_s=30, seed=3, notice_s=10)
    path = tmp_path / "t.csv"
    path.write_text(tr.write_events(t, "test"))
    back = tr.read_events(str(path), duration_s=600)
    assert [(round(e.time, 3), e.kind, e.node) for e in back.events] == \
           [(round(e.time, 3), e.kind, e.node) for e in t.events]


def test_exponential_notices_precede_their_losses_and_replacements_follow():
    t = tr.exponential(10, mtbf_s=300, duration_s=4800, replace_s=120, seed=0, notice_s=60)
    losses = {e.node: e.time for e in t.events if e.kind == "lose"}
    notices = {e.node: e.time for e in t.events if e.kind == "notice"}
    assert losses and all(losses[n] - notices[n] == pytest.approx(60) for n in notices)
    assert max(n for _, n in alive_over_time(t)) == 10  # a replacement never exceeds the size


def test_zone_outage_takes_every_live_node_of_the_zone():
    t = tr.zone_correlated(zones=2, nodes_per_zone=3, node_mtbf_s=1e9, zone_mtbf_s=600,
                           outage_s=100, replace_s=60, duration_s=2000, seed=2)
    first = next(e for e in t.events if e.kind == "lose")
    same_time = [e for e in t.events if e.kind == "lose" and e.time == first.time]
    assert len(same_time) == 3 and {e.zone for e in same_time} == {first.zone}


def test_bad_trace_files_name_the_field(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("0,10\nten,3\n")
    with pytest.raises(ValueError, match=r"trace.path: .*bad.csv:2"):
        tr.read_availability(str(bad))
    with pytest.raises(ValueError, match="trace.path: cannot read"):
        tr.read_availability(str(tmp_path / "missing.csv"))
