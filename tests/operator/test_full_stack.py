"""The whole stack: a LazarusJob applied with kubectl is scheduled by the real scheduler onto
simulated GPU/spot nodes; its pods run as real processes (tests/testcluster/kubelet.py plays
the kubelet): a coordinator and workers that train the tiny MoE on the CPU. Nodes are
deleted, warned, vanish or are lost a zone at a time, workers freeze or slow down, the
coordinator itself dies, and the job keeps training.

The node deletion and the spot notice also run in containers: every pod from the runtime
image (hack/images.sh), with its securityContext and limits, on a network of its own where
the job's Service names resolve; a deleted node's containers vanish without closing a
connection, as a reclaimed instance's do.

Each scenario records, from the coordinators' logs, the time from the fault to the next
completed step, the steps lost (committed, then rolled back to a checkpoint), the samples
lost or duplicated, and the expert replicas migrated, in build/e2e-results.json ("... in
containers" for the container runs).
"""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import yaml
from lazarus_core.plan import member_node

from jobkit import JobClient, kubectl, settle
from testcluster import faults
from testcluster.pooljob import on_pools
from testcluster.waits import wait_until

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "build" / "e2e-results.json"
EXAMPLE = ROOT / "examples" / "tiny-cpu.yaml"
# Losses of the same steps must agree this closely with a failure-free run (the runtime's
# equivalence tests use the same bound).
TOLERANCE = 1e-4
# Workers and the coordinator start in seconds; a step takes well under one.
STEP_TIMEOUT_S = 90
# The target for a lost node: its deletion to the next completed step.
NODE_LOSS_TARGET_S = 10
# The operator publishes the same nodes again after this long without a step.
STALL_S = 15
# Targets from fault to the next completed step: a coordinator lost or a node that vanished
# without Kubernetes noticing; a worker frozen past the heartbeat bound.
RECOVERY_TARGET_S = 10
FROZEN_TARGET_S = 15
# How long a real node lifecycle controller takes to mark a silent node NotReady.
NODE_MONITOR_GRACE_S = 40


def job_manifest(name: str, namespace: str, checkpoint_path: Path, image: str | None = None,
                 **spec) -> dict:
    """examples/tiny-cpu.yaml on this test's scratch nodes, its pods run by the local kubelet;
    with ``image``, from that image, the checkpoints on a hostPath volume all workers share."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    doc["spec"] |= {"rebalanceEverySteps": 0,
                    "checkpoint": {"path": str(checkpoint_path), "everySteps": 5}} | spec
    # After the spec: the pods ask for gpusPerNode GPUs.
    doc = on_pools(doc, namespace, {"lazarus.dev/scratch": namespace}, image=image)
    template = doc["spec"]["template"]
    # A dead peer is noticed through the plan long before this; it only bounds a collective
    # whose peer froze.
    template["env"] = [{"name": "LAZARUS_COLLECTIVE_TIMEOUT_S", "value": "30"},
                       {"name": "LAZARUS_LOG_LEVEL", "value": "INFO"}]
    if image:
        template["volumes"] = [{"name": "checkpoints", "hostPath": {
            "path": str(checkpoint_path), "type": "DirectoryOrCreate"}}]
        template["volumeMounts"] = [{"name": "checkpoints", "mountPath": str(checkpoint_path)}]
    return doc


@dataclass
class Stack:
    cluster: object
    namespace: str
    jobs: JobClient
    kubelet: object
    operator: object
    tmp: Path
    image: str | None = None  # the runtime image, when the pods run in containers
    name: str = "e2e"

    def apply(self, **spec) -> None:
        checkpoint = self.tmp / "ckpt"
        checkpoint.mkdir(exist_ok=True)
        checkpoint.chmod(0o777)  # as an admin prepares a hostPath: the image's user writes it
        path = self.tmp / f"{self.name}.yaml"
        path.write_text(yaml.safe_dump(job_manifest(self.name, self.namespace, checkpoint,
                                                    self.image, **spec)))
        kubectl(self.cluster, "apply", "-f", str(path))

    # --- what the coordinator says --------------------------------------------------------

    def events(self, kind: str) -> list[dict]:
        """Every coordinator incarnation's events of ``kind``, in time order."""
        found = []
        for path in self.kubelet.log_paths(f"{self.name}-coordinator-"):
            lines = (line for line in path.read_text(errors="replace").splitlines()
                     if line.startswith("{") and line.endswith("}"))
            found += [e | {"coordinator": path.parent.name}
                      for e in map(json.loads, lines) if e["event"] == kind]
        return sorted(found, key=lambda e: e["time"])

    def coordinator(self) -> str:
        """The newest coordinator pod that runs."""
        pods = self.cluster.core.list_namespaced_pod(
            self.namespace, label_selector=f"lazarus.dev/job={self.name},lazarus.dev/role=coordinator").items
        live = [p for p in pods if p.status.phase == "Running" and not p.metadata.deletion_timestamp]
        return max(live, key=lambda p: int(p.metadata.name.rsplit("-", 1)[1])).metadata.name


    def last_step(self) -> int:
        return max((e["step"] for e in self.events("step")), default=0)

    def generation(self) -> int:
        return max((e["generation"] for e in self.events("plan")), default=0)

    def wait_step(self, step: int, after_generation: int = 0) -> dict:
        """The first commit of ``step`` or later under a generation newer than the given."""
        return wait_until(
            lambda: next((e for e in self.events("step") if e["step"] >= step
                          and e["generation"] > after_generation), None),
            timeout=STEP_TIMEOUT_S, what=f"step {step} under a generation > {after_generation}",
            describe=self.describe)

    def describe(self) -> str:
        pods = self.cluster.core.list_namespaced_pod(self.namespace).items
        return (f"last step {self.last_step()}, plans {self.events('plan')}, pods "
                f"{[(p.metadata.name, p.status.phase, p.spec.node_name) for p in pods]}")

    def plan_nodes(self) -> list[str]:
        return self.jobs.plan_nodes(self.name)

    # --- measurements ---------------------------------------------------------------------

    def measure(self, scenario: str, fault_at: float, generation_before: int,
                replaced: str | None = None) -> dict:
        """From the coordinators' logs: the fault to the first step under a newer plan (or,
        when the coordinator ``replaced`` died, to the first step its successor made: it
        may go on with the plan the workers had), the steps committed and then rolled back,
        the samples lost or duplicated, the replicas migrated by the newer plans."""
        steps = self.events("step")
        before = max((e["step"] for e in steps if e["time"] < fault_at), default=0)
        resumed = next(e for e in steps if e["time"] > fault_at and (
            e["coordinator"] != replaced if replaced else e["generation"] > generation_before))
        plans = [e for e in self.events("plan") if e["generation"] > generation_before]
        restored = [p["restored_step"] for p in plans if p["restored_step"] is not None]
        result = {
            "fault_to_next_step_s": round(resumed["time"] - fault_at, 3),
            "resumed_at_step": resumed["step"],
            "steps_lost": before - min(restored) if restored else 0,
            "experts_migrated": sum(p["experts_migrated"] for p in plans),
            "generations": [p["generation"] for p in plans],
            "restored_step": min(restored) if restored else None,
        } | self.samples()
        record(scenario + (" in containers" if self.image else ""), result)
        return result

    def samples(self) -> dict:
        """Samples lost or duplicated over every step committed so far: each step's final
        commit must hold exactly the step's global batch (the data order depends on the step
        alone), and no step up to the last may be missing."""
        from lazarus_core.runtime_config import RuntimeConfig

        from lazarus_runtime.data import StepBatches

        runtime = yaml.safe_load(EXAMPLE.read_text())["spec"]["runtime"]
        cfg = RuntimeConfig.from_manifest(runtime)
        batches = StepBatches.from_config(cfg.data, cfg.model.seq_len, cfg.model.vocab)
        final = {e["step"]: e["samples"] for e in self.events("step")}
        lost = duplicated = 0
        for step in range(1, max(final, default=0) + 1):
            ids = final.get(step, [])
            expected = set(batches.global_sample_ids(step).tolist())
            lost += len(expected - set(ids))
            duplicated += len(ids) - len(set(ids)) + len(set(ids) - expected)
        return {"samples_lost": lost, "samples_duplicated": duplicated}

    def losses(self) -> dict[int, float]:
        """Each step's loss as last committed (a step redone after a restore counts anew)."""
        return {e["step"]: e["loss"] for e in self.events("step")}

    def commits(self) -> list[int]:
        return [e["step"] for e in self.events("step")]


def pod_processes(stack: Stack, pod_name: str) -> list[psutil.Process]:
    """A worker pod's processes: its node agent, then its rank processes."""
    agent = psutil.Process(stack.kubelet.process(pod_name).pid)
    return [agent] + sorted(agent.children(), key=lambda p: p.pid)


def signal_all(procs: list[psutil.Process], signum: int) -> None:
    for p in procs:
        p.send_signal(signum)


def record(scenario: str, result: dict) -> None:
    RESULTS.parent.mkdir(exist_ok=True)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results[scenario] = result | {"recorded": time.strftime("%Y-%m-%dT%H:%M:%S")}
    RESULTS.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")


def start_operator(operator_factory, watch: str | None = None):
    """An operator for the e2e tier, with a coordinator port of its own: every
    coordinator listens on this host. (The job's pods need no RBAC installed beside it: the
    operator gives each job's coordinator a ServiceAccount and Role of its own.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return operator_factory(extra_args=(f"--coordinator-port={port}",
                                        f"--stall-seconds={STALL_S}"), watch=watch).start()


@pytest.fixture
def stack(request, cluster, namespace, operator_factory, jobs, scratch_nodes, tmp_path):
    """The job's pods as processes, or with ``indirect`` parametrization "containers", from
    the runtime image."""
    containers = getattr(request, "param", "processes") == "containers"
    kubelet = request.getfixturevalue("container_kubelet" if containers else "local_kubelet")
    image = request.getfixturevalue("images").runtime if containers else None
    scratch_nodes("system")  # the coordinator's on-demand node
    return Stack(cluster, namespace, jobs, kubelet, start_operator(operator_factory),
                 tmp_path, image)


# The scenarios that also run with every pod in a container.
BOTH_RUNTIMES = pytest.mark.parametrize("stack", ["processes", "containers"], indirect=True)


def reference_losses(tmp: Path, steps: int) -> list[float]:
    """The same job without failures, on the local backend."""
    from lazarus_core.job_spec import parse_manifest

    from lazarus_runtime.local_backend import LocalJob

    name, spec = parse_manifest(job_manifest("reference", "default", tmp / "ref-ckpt"))
    return LocalJob(name, spec, 2, steps, checkpoint_dir=tmp / "ref-ckpt", gpus=()).run().losses


def assert_losses_match(stack: Stack, m: dict, scenario: str | None = None) -> None:
    """Every step up to a few past the reconfiguration ``m`` measured: the reference run
    costs a fraction of a second per step, and the job keeps training meanwhile. With
    ``scenario``, the largest difference goes into its results."""
    upto = m["resumed_at_step"] + 5
    stack.wait_step(upto)
    losses = stack.losses()
    reference = reference_losses(stack.tmp, upto)
    worst = max(abs(losses[s] - reference[s - 1]) for s in range(1, upto + 1))
    if scenario is not None:
        record(scenario, m | {"largest_loss_difference": worst})
    assert worst <= TOLERANCE, f"largest loss difference {worst:.2e} over {upto} steps"


@BOTH_RUNTIMES
def test_a_deleted_node_costs_one_reconfiguration_and_the_losses_match(cluster, stack,
                                                                       scratch_nodes):
    scratch_nodes("gpu-spot", num_zones=2, nodes_per_zone=2)
    stack.apply()
    stack.wait_step(6)
    assert len(stack.plan_nodes()) == 4
    victim, generation = stack.plan_nodes()[-1], stack.generation()

    fault_at = time.time()
    faults.delete_node(cluster.core, victim)
    stack.wait_step(stack.last_step() + 6, after_generation=generation)

    m = stack.measure("node deleted", fault_at, generation)
    assert victim not in stack.plan_nodes() and len(stack.plan_nodes()) == 3
    assert m["steps_lost"] == 0 and m["restored_step"] is None
    assert m["fault_to_next_step_s"] < NODE_LOSS_TARGET_S, m
    commits = stack.commits()
    assert commits == sorted(set(commits)), "a committed step was committed again"
    assert_losses_match(stack, m)


def test_two_ranks_per_node_survive_a_lost_rank_then_a_lost_node(cluster, stack,
                                                                  scratch_nodes):
    # Each worker pod runs the node agent with gpusPerNode rank processes (on the CPU here).
    # 4 slots per rank: the 2 ranks left at the end hold the 4 experts x 2 replicas.
    scratch_nodes("gpu-spot", num_zones=1, nodes_per_zone=2)
    stack.apply(replicas=2, minNodes=1, gpusPerNode=2)
    stack.wait_step(6)
    assert len(stack.plan_nodes()) == 2
    [first] = stack.events("plan")
    assert first["workers"] == 4, first  # two nodes, two ranks each
    pod = stack.jobs.workers(stack.name)[-1]
    agent, *ranks = pod_processes(stack, pod.metadata.name)
    assert len(ranks) == 2
    generation = stack.generation()

    fault_at = time.time()
    ranks[1].kill()  # one GPU fails: its rank dies, its agent and the other rank go on
    stack.wait_step(stack.last_step() + 3, after_generation=generation)
    m = stack.measure("a rank of a node lost (its GPU)", fault_at, generation)
    [plan, *_] = [p for p in stack.events("plan") if p["generation"] > generation]
    assert plan["reason"] == "GpuLost" and plan["workers"] == 3, plan
    assert pod.spec.node_name in stack.plan_nodes() and agent.is_running()
    assert [e["worker"] for e in stack.events("lost")] == [f"{pod.spec.node_name}/1"]
    assert m["fault_to_next_step_s"] < RECOVERY_TARGET_S, m
    assert_nothing_lost(m)

    generation = stack.generation()
    fault_at = time.time()
    faults.delete_node(cluster.core, pod.spec.node_name)  # now the whole node
    stack.wait_step(stack.last_step() + 3, after_generation=generation)
    m = stack.measure("the node of the lost rank deleted", fault_at, generation)
    [plan, *_] = [p for p in stack.events("plan") if p["generation"] > generation]
    assert plan["reason"] == "NodeLost" and plan["workers"] == 2, plan
    assert pod.spec.node_name not in stack.plan_nodes() and len(stack.plan_nodes()) == 1
    assert m["fault_to_next_step_s"] < NODE_LOSS_TARGET_S, m
    commits = stack.commits()
    assert commits == sorted(set(commits)), "a committed step was committed again"
    assert_nothing_lost(m)
    assert_losses_match(stack, m, "the node of the lost rank deleted")


def sole_holders(plan: dict) -> set[str]:
    """The nodes holding some expert (in some layer) that no other node holds."""
    found = set()
    for layer in plan["layers"]:
        for e in range(plan["experts"]):
            holders = {plan["nodes"][i]["name"] for i, slots in enumerate(layer["placement"])
                       if e in slots}
            if len(holders) == 1:
                found |= holders
    return found


@BOTH_RUNTIMES
def test_a_spot_notice_moves_the_experts_off_before_the_reclaim(cluster, stack, scratch_nodes):
    scratch_nodes("gpu-spot", num_zones=2, nodes_per_zone=2)
    # 5 experts in 4 x 2 slots: some expert has a single replica, so the node holding it
    # must send it away before it goes.
    runtime = yaml.safe_load(EXAMPLE.read_text())["spec"]["runtime"] | {"experts": 5}
    stack.apply(slotsPerGpu=2, minReplicas=1, runtime=runtime)
    stack.wait_step(6)
    victim, generation = sorted(sole_holders(stack.jobs.plan(stack.name)))[0], stack.generation()

    notice_at = time.time()
    faults.spot_notice(cluster.core, victim, "aws")
    stack.wait_step(stack.last_step() + 3, after_generation=generation)
    [plan] = [p for p in stack.events("plan") if p["generation"] > generation]
    # At a step boundary, the noticed node sending the experts only it held.
    assert plan["boundary"] and plan["reason"] == "SpotNotice", plan
    # The noticed node's ranks (one: gpusPerNode 1) are the draining workers.
    assert [member_node(m) for m in plan["draining"]] == [victim], plan
    assert plan["experts_migrated"] > 0, plan
    m = stack.measure("spot notice", notice_at, generation)
    # The reclaim itself, once the experts left: no reconfiguration, no step redone.
    faults.delete_node(cluster.core, victim)
    stack.wait_step(stack.last_step() + 3)
    assert stack.generation() == generation + 1
    commits = stack.commits()
    assert commits == list(range(1, len(commits) + 1)), "a step was lost or redone"
    assert m["steps_lost"] == 0


def test_two_nodes_then_a_whole_zone_lost_recovers_from_the_checkpoint(cluster, stack,
                                                                       scratch_nodes):
    # The job's zones: A with two nodes, B and C with one each.
    [(zone_a, _)] = scratch_nodes("gpu-spot", num_zones=1, nodes_per_zone=2).items()
    others = [n for names in scratch_nodes("gpu-spot", num_zones=2).values() for n in names]
    stack.apply()
    stack.wait_step(6)
    generation = stack.generation()

    # Two nodes at once, B's and C's: every expert keeps a replica in zone A.
    pair_at = time.time()
    for node in others:
        faults.delete_node(cluster.core, node)
    stack.wait_step(stack.last_step() + 4, after_generation=generation)
    pair = stack.measure("two nodes lost at once", pair_at, generation)
    assert pair["restored_step"] is None and pair["steps_lost"] == 0
    assert len(stack.plan_nodes()) == 2

    # Then zone A, where every survivor runs: no replica of anything is left, by design.
    generation = stack.generation()
    wait_until(lambda: (stack.jobs.status(stack.name).get("checkpointStep") or 0) >= 5,
               timeout=STEP_TIMEOUT_S, what="a checkpoint")
    zone_at = time.time()
    faults.zone_down(cluster.core, zone_a, delete=True)
    scratch_nodes("gpu-spot", num_zones=1, nodes_per_zone=2)  # capacity comes back elsewhere
    stack.wait_step(stack.last_step() + 1, after_generation=generation)
    zone = stack.measure("zone lost: checkpoint restore", zone_at, generation)
    assert zone["restored_step"] is not None and zone["restored_step"] % 5 == 0, zone
    assert_losses_match(stack, zone)


def test_new_nodes_join_and_the_job_grows_into_them(cluster, stack, scratch_nodes):
    scratch_nodes("gpu-spot", num_zones=1, nodes_per_zone=2)
    stack.apply()
    stack.wait_step(4)
    assert len(stack.plan_nodes()) == 2
    generation = stack.generation()

    joined_at = time.time()
    scratch_nodes("gpu-spot", num_zones=1, nodes_per_zone=2)
    stack.wait_step(stack.last_step() + 4, after_generation=generation)

    wait_until(lambda: len(stack.plan_nodes()) == 4, timeout=STEP_TIMEOUT_S,
               what="both new nodes in the plan", describe=stack.describe)
    stack.wait_step(stack.last_step() + 2, after_generation=stack.generation() - 1)
    m = stack.measure("nodes joined", joined_at, generation)
    # One growth or one per node, as they come up: each at a step boundary.
    plans = [p for p in stack.events("plan") if p["generation"] > generation]
    assert all(p["boundary"] and p["reason"] == "NodeJoined" for p in plans), plans
    assert plans[-1]["workers"] == 4
    commits = stack.commits()
    assert commits == list(range(1, len(commits) + 1)), "growing lost or redid a step"
    assert m["steps_lost"] == 0
    assert_losses_match(stack, m)


def assert_nothing_lost(m: dict) -> None:
    assert m["steps_lost"] == 0 and m["samples_lost"] == 0 and m["samples_duplicated"] == 0, m


def test_a_worker_frozen_past_the_heartbeat_bound_is_dropped_then_taken_back(cluster, stack,
                                                                            scratch_nodes):
    scratch_nodes("gpu-spot", num_zones=2, nodes_per_zone=2)
    stack.apply()
    stack.wait_step(6)
    generation = stack.generation()
    pod = stack.jobs.workers(stack.name)[0]
    frozen = pod_processes(stack, pod.metadata.name)

    frozen_at = time.time()
    signal_all(frozen, signal.SIGSTOP)  # a hung machine: alive, sockets open, silent
    stack.wait_step(stack.last_step() + 3, after_generation=generation)
    m = stack.measure("worker frozen past the heartbeat bound", frozen_at, generation)
    [plan, *_] = [p for p in stack.events("plan") if p["generation"] > generation]
    assert plan["reason"] == "NodeLost" and not plan["boundary"], plan
    assert pod.spec.node_name not in stack.plan_nodes()
    assert [member_node(e["worker"]) for e in stack.events("lost")][:1] == [pod.spec.node_name]
    assert m["fault_to_next_step_s"] < FROZEN_TARGET_S, m

    signal_all(frozen, signal.SIGCONT)  # it resumes: taken back at a step boundary
    wait_until(lambda: pod.spec.node_name in stack.plan_nodes(), timeout=STEP_TIMEOUT_S,
               what="the resumed worker back in the plan", describe=stack.describe)
    stack.wait_step(stack.last_step() + 3, after_generation=stack.generation() - 1)
    commits = stack.commits()
    assert commits == sorted(set(commits)), "a committed step was committed again"
    assert_nothing_lost(m | stack.samples())
    assert_losses_match(stack, m, "worker frozen past the heartbeat bound")


def test_a_throttled_worker_slows_the_steps_but_costs_no_replan(cluster, stack, scratch_nodes):
    scratch_nodes("gpu-spot", num_zones=2, nodes_per_zone=2)
    stack.apply()
    stack.wait_step(8)
    generation = stack.generation()
    procs = pod_processes(stack, stack.jobs.workers(stack.name)[0].metadata.name)

    def pace(since: float, until: float) -> float:
        times = [e["time"] for e in stack.events("step") if since <= e["time"] <= until]
        return (times[-1] - times[0]) / (len(times) - 1)

    settle(4)
    normal = pace(time.time() - 4, time.time())
    stop = threading.Event()

    def throttle():  # the worker gets a tenth of the CPU time, in 100 ms periods
        while not stop.is_set():
            signal_all(procs, signal.SIGSTOP)
            time.sleep(0.09)
            signal_all(procs, signal.SIGCONT)
            time.sleep(0.01)

    started = time.time()
    thread = threading.Thread(target=throttle, daemon=True)
    thread.start()
    try:
        settle(20)
    finally:
        stop.set()
        thread.join()
        signal_all(procs, signal.SIGCONT)
    slowed = pace(started + 2, time.time())
    record("worker throttled ten-fold", {"normal_step_s": round(normal, 3),
                                          "throttled_step_s": round(slowed, 3),
                                          "slowdown": round(slowed / normal, 1),
                                          "replans": stack.generation() - generation,
                                          "lost": [e["worker"] for e in stack.events("lost")]})
    # Really much slower. Ten-fold in principle, less in practice: on 2 cores the stopped
    # worker's CPU goes to the other ranks, so a step slows by less than the throttle (a
    # sixth of the CPU time gave only 2.69-3.98-fold, too near this bound). The bound only
    # has to tell a throttle from none.
    assert slowed >= 3 * normal, (normal, slowed)
    assert stack.generation() == generation and stack.events("lost") == []
    stack.wait_step(stack.last_step() + 3)


def kill_coordinator(stack: Stack, how: str) -> str:
    victim = stack.coordinator()
    if how == "process":
        stack.kubelet.process(victim).send_signal(signal.SIGKILL)
    else:
        stack.cluster.core.delete_namespaced_pod(victim, stack.namespace)
    return victim


@pytest.mark.parametrize("how", ["process", "pod"])
def test_the_coordinator_dies_and_training_goes_on_from_the_committed_step(
        cluster, stack, scratch_nodes, how):
    scenario = {"process": "coordinator process SIGKILLed",
                "pod": "coordinator pod deleted"}[how]
    scratch_nodes("gpu-spot", num_zones=2, nodes_per_zone=2)
    stack.apply()
    stack.wait_step(6)
    generation = stack.generation()

    fault_at = time.time()
    victim = kill_coordinator(stack, how)
    wait_until(lambda: any(e["coordinator"] != victim for e in stack.events("step")),
               timeout=STEP_TIMEOUT_S, what="a step by the new coordinator",
               describe=stack.describe)
    m = stack.measure(scenario, fault_at, generation, replaced=victim)
    assert stack.coordinator() != victim
    assert m["fault_to_next_step_s"] < RECOVERY_TARGET_S, m
    assert m["restored_step"] is None  # from the workers' memory, not the checkpoint
    assert_nothing_lost(m)
    assert any(e.reason == "CoordinatorReplaced" for e in stack.jobs.events(stack.name))
    assert_losses_match(stack, m, scenario)


def test_the_coordinator_and_a_worker_die_at_once(cluster, stack, scratch_nodes):
    scenario = "coordinator and a worker killed at once"
    scratch_nodes("gpu-spot", num_zones=2, nodes_per_zone=2)
    stack.apply()
    stack.wait_step(6)
    generation = stack.generation()
    worker = stack.jobs.workers(stack.name)[-1]

    fault_at = time.time()
    stack.kubelet.process(worker.metadata.name).send_signal(signal.SIGKILL)
    kill_coordinator(stack, "process")
    stack.wait_step(stack.last_step() + 3, after_generation=generation)
    m = stack.measure(scenario, fault_at, generation)
    # The next generation goes on without it (the operator then gives its node a new worker,
    # which joins at a later step boundary).
    first = next(p for p in stack.events("plan") if p["generation"] > generation)
    assert first["workers"] == 3 and first["reason"] == "NodeLost", first
    assert m["fault_to_next_step_s"] < RECOVERY_TARGET_S, m
    # Every expert kept a replica among the survivors: recovered from memory.
    assert m["restored_step"] is None
    assert_nothing_lost(m)
    assert_losses_match(stack, m, scenario)


def test_a_node_that_vanishes_is_replanned_long_before_kubernetes_notices(cluster, stack,
                                                                          scratch_nodes):
    scenario = "node vanished, NotReady only 40 s later"
    scratch_nodes("gpu-spot", num_zones=2, nodes_per_zone=2)
    stack.apply()
    stack.wait_step(6)
    generation = stack.generation()
    victim = stack.plan_nodes()[-1]

    fault_at = time.time()
    stack.kubelet.vanish(victim)  # its processes die; its Node object still reads Ready
    stack.wait_step(stack.last_step() + 3, after_generation=generation)
    m = stack.measure(scenario, fault_at, generation)
    # Re-planned on the workers' evidence alone: Kubernetes still shows the node Ready.
    ready = {c.type: c.status for c in cluster.core.read_node(victim).status.conditions}
    assert ready["Ready"] == "True"
    assert victim not in stack.plan_nodes()
    assert m["fault_to_next_step_s"] < RECOVERY_TARGET_S, m
    assert_nothing_lost(m)
    # Kubernetes notices only now, as a node lifecycle controller would: it confirms a plan
    # already made, and costs no further reconfiguration.
    settled = stack.generation()
    time.sleep(max(0.0, fault_at + NODE_MONITOR_GRACE_S - time.time()))
    faults.make_not_ready(cluster.core, victim)
    stack.wait_step(stack.last_step() + 3)
    assert stack.generation() == settled
    assert_losses_match(stack, m, scenario)


def test_the_operator_killed_mid_reconfiguration_still_converges(cluster, stack,
                                                                 scratch_nodes):
    nodes = [n for names in scratch_nodes("gpu-spot", num_zones=2, nodes_per_zone=2).values()
             for n in names]
    stack.apply()
    stack.wait_step(6)
    generation = stack.generation()

    faults.delete_node(cluster.core, nodes[0])
    stack.jobs.wait_generation(stack.name, generation + 1)
    stack.operator.kill()  # right after publishing: the workers are regrouping
    fault_at = time.time()
    faults.delete_node(cluster.core, nodes[1])  # and a second loss while it is down
    stack.operator.start()
    stack.wait_step(stack.last_step() + 4, after_generation=generation + 1)

    m = stack.measure("operator killed mid-reconfiguration", fault_at, generation + 1)
    assert sorted(stack.plan_nodes()) == sorted(nodes[2:])
    assert m["steps_lost"] == 0
    commits = stack.commits()
    assert commits == sorted(set(commits)), "a committed step was committed again"
    assert_losses_match(stack, m)


def test_a_job_with_spec_steps_trains_that_many_and_finishes(cluster, stack, scratch_nodes):
    scratch_nodes("gpu-spot", num_zones=1, nodes_per_zone=2)
    stack.apply(replicas=2, maxNodes=2, steps=30)

    wait_until(lambda: stack.jobs.condition(stack.name, "Ready").get("reason") == "Succeeded",
               timeout=STEP_TIMEOUT_S, what="the job's Ready condition to read Succeeded",
               describe=stack.describe)
    assert [e["step"] for e in stack.events("finished")] == [30]
    assert stack.commits() == list(range(1, 31))
    assert stack.jobs.status(stack.name)["step"] == 30

    def phases():
        return {p.metadata.name: p.status.phase
                for p in cluster.core.list_namespaced_pod(stack.namespace).items}
    # Every process exits 0; the pods stay, with their logs, and none replaces them.
    wait_until(lambda: set(phases().values()) == {"Succeeded"}, timeout=30,
               what="the coordinator and workers to exit 0", describe=lambda: str(phases()))
    # Its store served until both ranks had left: none was cut off before reading the stop.
    assert [e.get("still_running") for e in stack.events("stopped")] == [None]
    settle(3)
    assert sorted(phases()) == ["e2e-coordinator-0", "e2e-worker-0", "e2e-worker-1"]


def test_a_hostile_pod_without_the_key_changes_nothing(cluster, stack, scratch_nodes, namespace):
    """A pod in the job's namespace, wearing the job's label (so a NetworkPolicy selecting
    the job's pods would let it in too), runs tests/hostile_store_client.py as a real
    process: it connects to the coordinator's store and, round after round, writes a stop,
    forges and replays commits and directives, points the workers at a generation of its
    making, bumps counters and deletes keys. No network plugin runs here, so the job's
    NetworkPolicy is not enforced and the pod does reach the store: the job's key, which
    it does not have, is what stops it. The job trains on, in the same generation."""
    nodes = [n for names in scratch_nodes("gpu-spot", num_zones=2, nodes_per_zone=2).values()
             for n in names]
    stack.apply()
    stack.wait_step(6)
    generation = stack.generation()
    coordinator = cluster.core.read_namespaced_pod(f"{stack.name}-coordinator-0", namespace)
    port = coordinator.spec.containers[0].ports[0].container_port
    cluster.core.create_namespaced_pod(namespace, {
        "metadata": {"name": "hostile", "labels": {"lazarus.dev/kubelet": "local",
                                                   "lazarus.dev/job": stack.name}},
        "spec": {"nodeName": nodes[0], "restartPolicy": "Never",
                 "tolerations": [{"operator": "Exists"}],
                 "containers": [{
                     "name": "attacker", "image": "python",
                     "command": ["python", str(ROOT / "tests" / "hostile_store_client.py"),
                                 "$(TARGET)"],
                     "env": [{"name": "TARGET",
                              "value": f"{stack.name}-coordinator.{namespace}.svc:{port}"}]}]}})
    attack_log = stack.kubelet.log_path("hostile")

    def rounds() -> int:  # the attacker prints the number of each round it completes
        return sum(line.isdigit() for line in attack_log.read_text().splitlines())

    # The attacker imports torch before its first round: seconds on a busy host (60 s ran
    # out once with four workers training on two cores).
    wait_until(lambda: attack_log.exists() and rounds() >= 5,
               timeout=STEP_TIMEOUT_S, what="the hostile pod's first rounds",
               describe=lambda: (attack_log.read_text()[-2000:] if attack_log.exists()
                                 else "no log from the hostile pod"))
    attacked_from = stack.last_step()
    stack.wait_step(attacked_from + 10)
    assert rounds() >= 5, attack_log.read_text()[-2000:]
    # Same generation, no stop, no step committed twice, and the forgeries were seen.
    assert stack.generation() == generation and not stack.events("finished")
    commits = stack.commits()
    assert commits == list(range(1, len(commits) + 1)), commits
    coordinator_log = stack.kubelet.log_path(f"{stack.name}-coordinator-0").read_text()
    assert "not signed with the job's key" in coordinator_log, coordinator_log[-3000:]
    status = stack.jobs.status(stack.name)
    assert status["generation"] == generation and status["readyNodes"] == 4
