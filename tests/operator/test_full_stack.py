"""The whole stack: a LazarusJob applied with kubectl is scheduled by the real scheduler onto
simulated GPU/spot nodes; its pods run as real processes (tests/testcluster/kubelet.py plays
the kubelet): a coordinator and workers that train the tiny MoE on the CPU. Nodes are
deleted, warned, or lost a zone at a time, and the job keeps training.

Each scenario records, from the coordinator's log, the time from the fault to the next
completed step, the steps lost (committed, then rolled back to a checkpoint) and the expert
replicas migrated, in build/e2e-results.json.
"""
from __future__ import annotations

import json
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

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


def job_manifest(name: str, namespace: str, checkpoint: Path, **spec) -> dict:
    """examples/tiny-cpu.yaml on this test's scratch nodes, its pods run by the local kubelet."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    doc = on_pools(doc, namespace, {"lazarus.dev/scratch": namespace})
    doc["spec"] |= {"rebalanceEverySteps": 0,
                    "checkpoint": {"path": str(checkpoint), "everySteps": 5}} | spec
    # A dead peer is noticed through the plan long before this; it only bounds a collective
    # whose peer froze.
    doc["spec"]["template"]["env"] = [{"name": "LAZARUS_COLLECTIVE_TIMEOUT_S", "value": "30"},
                                      {"name": "LAZARUS_LOG_LEVEL", "value": "INFO"}]
    return doc


@dataclass
class Stack:
    cluster: object
    namespace: str
    jobs: JobClient
    kubelet: object
    operator: object
    tmp: Path
    name: str = "e2e"

    def apply(self, **spec) -> None:
        path = self.tmp / f"{self.name}.yaml"
        path.write_text(yaml.safe_dump(job_manifest(self.name, self.namespace,
                                                    self.tmp / "ckpt", **spec)))
        kubectl(self.cluster, "apply", "-f", str(path))

    # --- what the coordinator says --------------------------------------------------------

    def events(self, kind: str) -> list[dict]:
        path = self.kubelet.log_path(f"{self.name}-coordinator")
        if not path.exists():
            return []
        lines = (line for line in path.read_text(errors="replace").splitlines()
                 if line.startswith("{"))
        return [e for e in map(json.loads, lines) if e["event"] == kind]

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

    def measure(self, scenario: str, fault_at: float, generation_before: int) -> dict:
        """From the coordinator's log: the fault to the first step under a newer plan, the
        steps committed and then rolled back, the replicas migrated by the newer plans."""
        steps = self.events("step")
        before = max((e["step"] for e in steps if e["time"] < fault_at), default=0)
        resumed = next(e for e in steps if e["time"] > fault_at
                       and e["generation"] > generation_before)
        plans = [e for e in self.events("plan") if e["generation"] > generation_before]
        restored = [p["restored_step"] for p in plans if p["restored_step"] is not None]
        result = {
            "fault_to_next_step_s": round(resumed["time"] - fault_at, 3),
            "resumed_at_step": resumed["step"],
            "steps_lost": before - min(restored) if restored else 0,
            "experts_migrated": sum(p["experts_migrated"] for p in plans),
            "generations": [p["generation"] for p in plans],
            "restored_step": min(restored) if restored else None,
        }
        record(scenario, result)
        return result

    def losses(self) -> dict[int, float]:
        """Each step's loss as last committed (a step redone after a restore counts anew)."""
        return {e["step"]: e["loss"] for e in self.events("step")}

    def commits(self) -> list[int]:
        return [e["step"] for e in self.events("step")]


def record(scenario: str, result: dict) -> None:
    RESULTS.parent.mkdir(exist_ok=True)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results[scenario] = result | {"recorded": time.strftime("%Y-%m-%dT%H:%M:%S")}
    RESULTS.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")


@pytest.fixture
def stack(cluster, namespace, operator_factory, jobs, local_kubelet, scratch_nodes, tmp_path):
    scratch_nodes("system")  # the coordinator's on-demand node
    with socket.socket() as s:  # every coordinator listens on this host: one port each
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    op = operator_factory(extra_args=(f"--coordinator-port={port}",
                                      f"--stall-seconds={STALL_S}")).start()
    return Stack(cluster, namespace, jobs, local_kubelet, op, tmp_path)


def reference_losses(tmp: Path, steps: int) -> list[float]:
    """The same job without failures, on the local backend."""
    from lazarus_core.job_spec import parse_manifest

    from lazarus_runtime.local_backend import LocalJob

    name, spec = parse_manifest(job_manifest("reference", "default", tmp / "ref-ckpt"))
    return LocalJob(name, spec, 2, steps, checkpoint_dir=tmp / "ref-ckpt").run().losses


def assert_losses_match(stack: Stack, m: dict) -> None:
    """Every step up to a few past the reconfiguration ``m`` measured: the reference run
    costs a fraction of a second per step, and the job keeps training meanwhile."""
    upto = m["resumed_at_step"] + 5
    stack.wait_step(upto)
    losses = stack.losses()
    reference = reference_losses(stack.tmp, upto)
    worst = max(abs(losses[s] - reference[s - 1]) for s in range(1, upto + 1))
    assert worst <= TOLERANCE, f"largest loss difference {worst:.2e} over {upto} steps"


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
    assert plan["draining"] == [victim] and plan["experts_migrated"] > 0, plan
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


def test_a_frozen_worker_stalls_the_job_until_the_operator_republishes(cluster, stack,
                                                                      scratch_nodes):
    scratch_nodes("gpu-spot", num_zones=2, nodes_per_zone=2)
    stack.apply()
    stack.wait_step(6)
    generation = stack.generation()
    frozen = stack.kubelet.process(stack.jobs.workers(stack.name)[0].metadata.name)

    frozen_at = time.time()
    frozen.send_signal(signal.SIGSTOP)  # a hung driver: alive, silent, holding its peers
    wait_until(lambda: stack.generation() > generation, timeout=STALL_S + 30,
               what="the operator to publish the stalled job's nodes again",
               describe=stack.describe)
    frozen.send_signal(signal.SIGCONT)
    stack.wait_step(stack.last_step() + 3, after_generation=generation)

    m = stack.measure("worker frozen, then back", frozen_at, generation)
    [plan, *_] = [p for p in stack.events("plan") if p["generation"] > generation]
    assert plan["reason"] == "Stalled" and not plan["boundary"], plan
    assert len(stack.plan_nodes()) == 4 and m["steps_lost"] == 0
    assert m["fault_to_next_step_s"] >= STALL_S
    commits = stack.commits()
    assert commits == sorted(set(commits)), "a committed step was committed again"


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
    settle(3)
    assert sorted(phases()) == ["e2e-coordinator", "e2e-worker-0", "e2e-worker-1"]


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
    coordinator = cluster.core.read_namespaced_pod(f"{stack.name}-coordinator", namespace)
    port = coordinator.spec.containers[0].ports[0].container_port
    cluster.core.create_namespaced_pod(namespace, {
        "metadata": {"name": "hostile", "labels": {"lazarus.dev/kubelet": "local",
                                                   "lazarus.dev/job": stack.name}},
        "spec": {"nodeName": nodes[0], "restartPolicy": "Never",
                 "tolerations": [{"operator": "Exists"}],
                 "containers": [{
                     "name": "attacker", "image": "python",
                     "command": ["python", "tests/hostile_store_client.py", "$(TARGET)"],
                     "env": [{"name": "TARGET",
                              "value": f"{stack.name}-coordinator.{namespace}.svc:{port}"}]}]}})
    attack_log = stack.kubelet.log_path("hostile")
    wait_until(lambda: attack_log.exists() and len(attack_log.read_text().split()) >= 5,
               timeout=60, what="the hostile pod's first rounds")
    attacked_from = stack.last_step()
    stack.wait_step(attacked_from + 10)
    rounds = len(attack_log.read_text().split())
    assert rounds >= 5, attack_log.read_text()[-2000:]
    # Same generation, no stop, no step committed twice, and the forgeries were seen.
    assert stack.generation() == generation and not stack.events("finished")
    commits = stack.commits()
    assert commits == list(range(1, len(commits) + 1)), commits
    coordinator_log = stack.kubelet.log_path(f"{stack.name}-coordinator").read_text()
    assert "not signed with the job's key" in coordinator_log
    status = stack.jobs.status(stack.name)
    assert status["generation"] == generation and status["readyNodes"] == 4
