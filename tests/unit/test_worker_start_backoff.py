"""No crash loops: workers that fail before their first step are replaced with an
exponential backoff, and the job's Ready condition says why they fail."""
from lazarus_core import controller as c
from lazarus_core.job_spec import parse_spec
from lazarus_core.topology import NodeSpec
from lazarus_operator.observe import observe_workers

T0 = 1_000.0
ERROR = "exit code 2: lazarus worker: error: spec.runtime.model: unknown model 'gpt-xxl'"


def job():
    spec = parse_spec({"runtime": {"experts": 4, "layers": 2}, "minNodes": 2, "maxNodes": 2,
                       "slotsPerGpu": 4})
    return c.new_job(spec, c.Settings(start_grace_s=0, start_backoff_s=2,
                                      start_backoff_max_s=30))


def nodes(*names):
    return tuple(NodeSpec(n, 1, 4, "a") for n in names)


def ready(state):
    return {x["type"]: x for x in c.conditions(state, [], "t")}["Ready"]


def test_failures_before_the_first_step_back_off_exponentially_up_to_the_cap():
    state, now, waits = job(), T0, []
    for _ in range(6):
        out = c.handle_all(state, [c.WorkerFailed("n0", ERROR), c.Tick()], now)
        state = out.state
        assert out.retry_at == state.start_retry_at
        waits.append(out.retry_at - now)
        assert state.missing_workers(0, now) == 0  # nothing is started while backing off
        assert state.missing_workers(0, out.retry_at) == 2
        now = out.retry_at
    assert waits == [2, 4, 8, 16, 30, 30]
    r = ready(state)
    assert (r["status"], r["reason"]) == ("False", "WorkerStartFailed")
    assert ERROR in r["message"] and "6 worker(s)" in r["message"]


def test_a_worker_that_trained_and_then_failed_is_a_lost_node_not_a_start_failure():
    out = c.handle(job(), c.NodesJoined(nodes("n0", "n1")), T0)
    state = c.handle(out.state, c.Progress(step=1, generation=1), T0).state
    assert state.proven == {"n0", "n1"}
    state = c.handle_all(state, [c.WorkerFailed("n0", ERROR), c.NodesLost(("n0",))], T0).state
    assert state.start_failures == 0 and state.missing_workers(0, T0) == 1
    # The worker that replaces it on n0 has to prove itself again.
    assert "n0" not in state.proven
    state = c.handle(state, c.WorkerFailed("n0", ERROR), T0).state
    assert state.start_failures == 1


def test_a_worker_that_starts_fine_ends_the_backoff():
    state = c.handle(job(), c.WorkerFailed("n9", ERROR), T0).state
    state = c.handle(state, c.NodesJoined(nodes("n0", "n1")), T0 + 3).state
    assert state.start_failures == 1  # a plan is out, but no worker has proved itself yet
    state = c.handle(state, c.Progress(step=1, generation=1), T0 + 5).state
    assert (state.start_failures, state.start_error, state.start_retry_at) == (0, None, None)
    assert ready(state)["status"] == "True"


JOB_UID = "job-uid"


def pod(name, phase, node="n0", **status):
    return {"metadata": {"name": name, "uid": f"uid-{name}", "labels": {},
                         "ownerReferences": [{"kind": "LazarusJob", "uid": JOB_UID}]},
            "spec": {"nodeName": node}, "status": {"phase": phase, **status}}


def test_failed_pods_are_reported_with_their_last_words_evictions_are_not():
    terminated = {"exitCode": 2, "reason": "Error",
                  "message": "Traceback (most recent call last):\n  ...\n" + ERROR[13:] + "\n"}
    pods = [pod("a", "Failed", containerStatuses=[{"state": {"terminated": terminated}}]),
            pod("b", "Failed", reason="Evicted"),
            pod("c", "Failed", node="n1", containerStatuses=[{"state": {"terminated": {
                "exitCode": 137, "reason": "OOMKilled"}}}])]
    obs = observe_workers(pods, {}, job().spec, JOB_UID)
    assert obs.failed == [("uid-a", "n0", ERROR), ("uid-c", "n1", "exit code 137: OOMKilled")]
    assert sorted(name for name, _ in obs.doomed) == ["a", "b", "c"]
