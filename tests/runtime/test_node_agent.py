"""The node agent: real processes. It starts a node's ranks, each pinned to its GPU (or the
CPU), reports a rank that dies to the coordinator's store while the others go on, passes
SIGTERM on, restarts nothing, and takes its ranks with it when it is killed itself."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist
from lazarus_core import process_env as penv

from gloo_harness import free_port
from lazarus_runtime.job_channel import JobChannel, RankExit
from testcluster.waits import wait_until

pytestmark = pytest.mark.slow

# A rank that tells what it was given, then sleeps (or exits at once with "exit", or fails
# with an error on stderr with "fail").
RANK = """
import json, os, sys, time
out = os.path.join(sys.argv[1], f"rank-{os.environ['LAZARUS_LOCAL_RANK']}.json")
names = ("LAZARUS_LOCAL_RANK", "LAZARUS_DEVICE", "LAZARUS_BACKEND", "CUDA_VISIBLE_DEVICES",
         "LAZARUS_NODE_NAME")
with open(out + ".tmp", "w") as f:
    json.dump({"pid": os.getpid(), **{n: os.environ.get(n) for n in names}}, f)
os.replace(out + ".tmp", out)
if sys.argv[2] == "fail":
    print("lazarus worker: error: spec.runtime.data: no such file /corpus", file=sys.stderr)
    sys.exit(1)
if sys.argv[2] == "sleep":
    time.sleep(60)
"""


JOB, KEY = "job", penv.new_job_key()


@pytest.fixture
def coordinator() -> JobChannel:
    """The coordinator's side of the store the agent reports to."""
    port = free_port()
    return JobChannel(dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False),
                      KEY, JOB)


def start_agent(tmp: Path, chan: JobChannel, ranks: int, mode: str, key: str = KEY,
                **env) -> subprocess.Popen:
    environ = dict(os.environ, **{penv.NODE_NAME: "node-a", penv.GPUS_PER_NODE: str(ranks),
                                  penv.COORDINATOR: f"127.0.0.1:{chan.store.port}",
                                  penv.JOB: JOB, penv.JOB_KEY: key,
                                  penv.LOG_LEVEL: "INFO"}, **env)
    return subprocess.Popen(
        [sys.executable, "-m", "lazarus_runtime.node_agent", "--",
         sys.executable, "-c", RANK, str(tmp), mode],
        env=environ, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def alive(pid: int) -> bool:
    """Running: a killed process may linger as a zombie until its new parent reaps it."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def reports(tmp: Path, ranks: int) -> list[dict]:
    paths = [tmp / f"rank-{i}.json" for i in range(ranks)]
    wait_until(lambda: all(p.exists() for p in paths), timeout=30, what="every rank to start")
    return [json.loads(p.read_text()) for p in paths]


@pytest.mark.parametrize("visible, expected, backend", [
    ("", [""] * 3, "gloo"),                      # no GPU: three ranks on the CPU
    ("4,5", ["4", "5", "4"], "gloo"),            # three ranks on two GPUs share them
    ("4,5,6", ["4", "5", "6"], "nccl"),          # a GPU each
])
def test_each_rank_is_started_on_its_own_device(tmp_path, coordinator, visible, expected,
                                                backend):
    agent = start_agent(tmp_path, coordinator, 3, "exit", CUDA_VISIBLE_DEVICES=visible)
    assert agent.wait(timeout=60) == 0  # every rank finished normally
    seen = reports(tmp_path, 3)
    assert [r["LAZARUS_LOCAL_RANK"] for r in seen] == ["0", "1", "2"]
    assert [r["CUDA_VISIBLE_DEVICES"] for r in seen] == expected
    assert {r["LAZARUS_DEVICE"] for r in seen} == {"cuda" if visible else "cpu"}
    assert {r["LAZARUS_BACKEND"] for r in seen} == {backend}
    assert {r["LAZARUS_NODE_NAME"] for r in seen} == {"node-a"}


def test_the_launchers_backend_wins_over_the_nodes_own_view(tmp_path, coordinator):
    # The local backend sees that two nodes' ranks share the machine's GPUs; each agent
    # alone would think it has a GPU per rank.
    agent = start_agent(tmp_path, coordinator, 2, "exit", CUDA_VISIBLE_DEVICES="0,1",
                        LAZARUS_BACKEND="gloo")
    assert agent.wait(timeout=60) == 0
    assert {r["LAZARUS_BACKEND"] for r in reports(tmp_path, 2)} == {"gloo"}


@pytest.mark.timeout(120)
def test_a_dead_rank_is_reported_and_the_others_go_on_until_told_to_stop(tmp_path,
                                                                         coordinator):
    agent = start_agent(tmp_path, coordinator, 3, "sleep", CUDA_VISIBLE_DEVICES="")
    pids = [r["pid"] for r in reports(tmp_path, 3)]
    members = ["node-a/0", "node-a/1", "node-a/2"]
    assert coordinator.exits(members) == {}
    os.kill(pids[1], signal.SIGKILL)  # a GPU failed and took its rank with it
    wait_until(lambda: coordinator.exits(members), timeout=10,
               what="the agent to report its dead rank")
    assert coordinator.exits(members) == {"node-a/1": RankExit(-signal.SIGKILL, "")}
    assert agent.poll() is None, "the agent must outlive one of its ranks"
    assert alive(pids[0]) and alive(pids[2])
    assert not any(p.pid == pids[1] for p in psutil.Process(agent.pid).children())  # no restart
    agent.send_signal(signal.SIGTERM)  # the pod is deleted: the ranks are told, in turn
    code = agent.wait(timeout=30)
    log = agent.stderr.read()
    assert "rank 1 (the CPU) exited with status -9" in log, log
    assert code == 128 + signal.SIGKILL  # no rank finished normally; the first failure
    assert not alive(pids[0]) and not alive(pids[2])


@pytest.mark.timeout(120)
def test_the_agents_last_line_carries_the_failed_ranks_last_words(tmp_path, coordinator):
    """A pod's termination message is its log's tail; the operator quotes its last line
    when workers fail to start, so that line must be the rank's error, not the agent's."""
    agent = start_agent(tmp_path, coordinator, 2, "fail", CUDA_VISIBLE_DEVICES="",
                        LAZARUS_POD_UID="pod-uid-7")
    assert agent.wait(timeout=60) == 1
    lines = agent.stderr.read().strip().splitlines()
    assert lines[-1].startswith("lazarus node agent: error: rank "), lines
    assert "no such file /corpus" in lines[-1], lines
    assert sum(line.startswith("lazarus worker: error:") for line in lines) == 2  # relayed
    # The coordinator hears the same words at once, before the pod has ended (the operator
    # counts the start failure from that report).
    assert coordinator.exits(["node-a/0", "node-a/1"]) == {
        f"node-a/{r}": RankExit(1, "lazarus worker: error: spec.runtime.data: no such file "
                                   "/corpus", "pod-uid-7") for r in (0, 1)}


@pytest.mark.timeout(120)
def test_an_exit_report_under_another_key_is_not_believed(tmp_path, coordinator):
    agent = start_agent(tmp_path, coordinator, 2, "sleep", key=penv.new_job_key(),
                        CUDA_VISIBLE_DEVICES="")
    pids = [r["pid"] for r in reports(tmp_path, 2)]
    os.kill(pids[1], signal.SIGKILL)
    wait_until(lambda: coordinator.rejected > 0 or coordinator.exits(["node-a/1"]),
               timeout=10, what="the agent's report to arrive")
    assert coordinator.exits(["node-a/0", "node-a/1"]) == {}
    agent.kill()
    agent.wait(timeout=10)


@pytest.mark.timeout(120)
def test_a_killed_agent_takes_its_ranks_with_it(tmp_path, coordinator):
    agent = start_agent(tmp_path, coordinator, 2, "sleep", CUDA_VISIBLE_DEVICES="")
    pids = [r["pid"] for r in reports(tmp_path, 2)]
    agent.kill()  # the node is lost: no half of it may go on
    agent.wait(timeout=10)
    wait_until(lambda: not any(alive(p) for p in pids), timeout=10,
               what="the ranks to die with their agent")


def test_an_agent_without_its_node_names_the_variable():
    environ = {k: v for k, v in os.environ.items() if k != penv.NODE_NAME}
    done = subprocess.run([sys.executable, "-m", "lazarus_runtime.node_agent"],
                          env=environ | {penv.GPUS_PER_NODE: "2"}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert penv.NODE_NAME in done.stderr
