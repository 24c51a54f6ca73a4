"""How the coordinator judges, from the workers' own heartbeats and failure reports, that a
worker is lost long before Kubernetes would, and that a slow step is not a hang."""
from lazarus_core.liveness import (BEAT_S, BUSY_LIMIT_S, HANG_FLOOR_S, SILENT_S, SUSPECT_S,
                                   Beat, Liveness)

T0 = 100.0


def beating(live: Liveness, members, start: float, until: float, busy=lambda t: 0.0,
            in_step=True, counts=None):
    """Every member beats every BEAT_S from ``start`` to ``until``."""
    counts = counts if counts is not None else {}
    t = start
    while t <= until:
        for m in members:
            counts[m] = counts.get(m, 0) + 1
            live.beat(m, Beat(counts[m], busy(t), in_step), t)
        t += BEAT_S
    return counts


def test_a_silent_worker_is_lost_after_the_silence_bound_and_not_before():
    live = Liveness()
    counts = beating(live, ["a", "b"], T0, T0 + 5)
    beating(live, ["a"], T0 + 5 + BEAT_S, T0 + 5 + SILENT_S + 1, counts=counts)  # b froze
    assert live.lost(["a", "b"], T0 + 5 + SILENT_S - 0.5) == {}
    lost = live.lost(["a", "b"], T0 + 5 + SILENT_S + 0.5)
    assert list(lost) == ["b"] and "no heartbeat" in lost["b"]


def test_a_reported_peer_failure_shortens_the_bound_for_the_silent_one_only():
    live = Liveness()
    counts = beating(live, ["a", "b", "c"], T0, T0 + 2)
    live.peer_failed(T0 + 2.05)  # c was SIGKILLed; a's collective failed
    counts = beating(live, ["a", "b"], T0 + 2 + BEAT_S, T0 + 2 + SUSPECT_S + 0.5, counts=counts)
    assert list(live.lost(["a", "b", "c"], T0 + 2 + SUSPECT_S + 0.3)) == ["c"]


def test_a_loop_that_stands_still_while_the_thread_beats_is_a_hang():
    live = Liveness()
    for _ in range(10):
        live.step_took(0.1)
    assert live.hang_bound_s() == HANG_FLOOR_S
    # The heartbeat thread keeps beating; the training loop stopped moving at T0.
    beating(live, ["a"], T0, T0 + HANG_FLOOR_S + 1, busy=lambda t: t - T0)
    assert live.lost(["a"], T0 + HANG_FLOOR_S - 1) == {}
    lost = live.lost(["a"], T0 + HANG_FLOOR_S + 1)
    assert "training loop has not moved" in lost["a"]


def test_a_step_five_times_slower_than_usual_is_not_a_hang():
    live = Liveness()
    for _ in range(20):
        live.step_took(2.0)  # a big model: 2 s steps
    assert live.hang_bound_s() == 40.0
    # A throttled worker: each step takes 10 s, during which its loop is inside compute.
    beating(live, ["a"], T0, T0 + 10, busy=lambda t: (t - T0) % 10)
    assert live.lost(["a"], T0 + 10) == {}


def test_outside_a_step_only_the_generous_bound_applies():
    live = Liveness()
    beating(live, ["a"], T0, T0 + 30, busy=lambda t: t - T0, in_step=False)  # building the model
    assert live.lost(["a"], T0 + 30) == {}
    beating(live, ["a"], T0 + 30, T0 + BUSY_LIMIT_S + 1, busy=lambda t: t - T0, in_step=False,
            counts={"a": 10_000})
    assert "a" in live.lost(["a"], T0 + BUSY_LIMIT_S + 1)


def test_a_worker_that_beats_again_is_alive_again_and_one_never_heard_is_not_judged():
    live = Liveness()
    counts = beating(live, ["a"], T0, T0 + 1)
    assert "a" in live.lost(["a", "starting"], T0 + 1 + SILENT_S + 1)
    beating(live, ["a"], T0 + 10, T0 + 11, counts=counts)  # SIGCONT
    assert live.lost(["a", "starting"], T0 + 11) == {}
    assert live.heard("a") and not live.heard("starting")


def test_a_restarted_coordinator_judges_stalls_from_when_it_first_hears_each_worker():
    # The old coordinator died with a worker; the survivors' loops stood still for 10 s,
    # waiting for it, before this one started. They are not hung for that...
    live = Liveness()
    for _ in range(10):
        live.step_took(0.1)
    counts = beating(live, ["a", "b"], T0, T0 + 1, busy=lambda t: 10 + t - T0)
    assert live.lost(["a", "b"], T0 + 1) == {}
    # ...a loop that moves again is fine, and one that still does not move after the bound
    # counted from this coordinator's first hearing is a hang.
    beating(live, ["a"], T0 + 1 + BEAT_S, T0 + HANG_FLOOR_S + 1, counts=counts)
    beating(live, ["b"], T0 + 1 + BEAT_S, T0 + HANG_FLOOR_S + 1, busy=lambda t: 10 + t - T0,
            counts=counts)
    assert live.lost(["a", "b"], T0 + HANG_FLOOR_S - 1) == {}
    lost = live.lost(["a", "b"], T0 + HANG_FLOOR_S + 1)
    assert list(lost) == ["b"] and "training loop has not moved" in lost["b"]
