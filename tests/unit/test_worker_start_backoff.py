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


def test_the_wait_doubles_per_round_of_workers_not_per_worker():
    # Eight workers started together fail one after another: one backoff of 2 s for all.
    state, now = job(), T0
    for i in range(8):
        out = c.handle_all(state, [c.WorkerFailed(f"n{i}", ERROR), c.Tick()], now + i / 10)
        state = out.state
        assert out.retry_at == T0 + 2
    assert (state.start_failures, state.start_backoffs) == (8, 1)
    # The round started after it fails too: the next wait is twice as long.
    state = c.handle(state, c.WorkerFailed("n0", ERROR), T0 + 5).state
    assert (state.start_failures, state.start_retry_at) == (9, T0 + 5 + 4)
    assert "9 worker(s)" in ready(state)["message"]


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


def test_a_worker_whose_ranks_exited_backs_off_before_its_pod_ends_and_counts_once():
    """The coordinator hears a rank exit before Kubernetes shows its pod Failed. Its node is
    lost at once; were the failure counted only when the pod ends, a replacement would start
    in between, with no backoff (a crash loop at the speed of a worker's start-up)."""
    from lazarus_core.cluster_contract import exit_reason
    from lazarus_operator.apply import JobRecord
    from lazarus_operator.observe import NodeInfo

    infos = {n: NodeInfo(n, "a", True, True, frozenset()) for n in ("n0", "n1")}
    record, state, now = JobRecord(), job(), T0

    def observe_pass(pods, suspects=None):
        nonlocal state
        obs = observe_workers(pods, infos, state.spec, JOB_UID, suspects)
        events = [*record.new_failures(obs), *c.observe(state, obs.live, obs.noticed), c.Tick()]
        state = c.handle_all(state, events, now).state
        record.told(obs)
        return obs

    observe_pass([pod("w0", "Running"), pod("w1", "Running", node="n1")])
    assert state.alive == {"n0", "n1"} and state.plan is not None
    error = "ValueError: dataset: '/data/x.txt' is not an existing file"
    now += 1
    obs = observe_pass([pod("w0", "Running"), pod("w1", "Running", node="n1")],
                       {"n0/0": exit_reason(1, error, "uid-w0"),
                        "n1/0": exit_reason(1, error, "uid-w1")})
    assert obs.live == [] and state.start_failures == 2
    assert error in state.start_error
    assert state.missing_workers(0, now) == 0  # nothing replaces them yet
    # The pods end as their agents exit: already counted.
    ended = {"containerStatuses": [{"state": {"terminated": {"exitCode": 1, "message": error}}}]}
    now += 1
    observe_pass([pod("w0", "Failed", **ended), pod("w1", "Failed", node="n1", **ended)])
    assert state.start_failures == 2 and state.missing_workers(0, now) == 0
    assert state.missing_workers(0, state.start_retry_at) == 2
