"""The operator on the real control plane: a job starts, loses nodes, gets spot notices,
grows, scales, and survives the operator's own death. kwok simulates the nodes and the pods'
status; everything else (API server, scheduler, controllers, the operator) is real."""
import itertools
import json
from pathlib import Path

import pytest

from jobkit import kubectl, make_job, settle
from lazarus_core.cluster_contract import state_configmap_data, state_configmap_name
from lazarus_core.controller import Progress
from testcluster import faults
from testcluster.waits import wait_until

pytestmark = pytest.mark.cluster


def nodes_of(zones: dict) -> list[str]:
    return [n for names in zones.values() for n in names]


def started(jobs, scratch_nodes, name, nodes=4, zones=2, **spec):
    """A job on ``nodes`` fresh scratch GPU nodes, its generation 1 published."""
    made = nodes_of(scratch_nodes("gpu-spot", num_zones=zones, nodes_per_zone=nodes // zones))
    jobs.create(make_job(name, jobs.namespace, **spec))
    plan = jobs.wait_generation(name, 1)
    return made, plan


def test_the_operator_loads_the_replans_assignment_solver_when_it_starts(operator):
    """scipy's assignment solver, which a re-plan maps nodes and GPUs with, is loaded while
    the operator starts. Imported by the first re-plan instead, it held that re-plan 0.6 s:
    the first one after an operator restart, when a job may be losing nodes."""
    maps = Path(f"/proc/{operator.proc.pid}/maps")
    wait_until(lambda: "scipy/optimize/_lsap" in maps.read_text(), timeout=20,
               what="the operator to load scipy's assignment solver")


def test_a_job_starts_on_the_gpu_pool_and_publishes_generation_1(operator, jobs, scratch_nodes):
    made, plan = started(jobs, scratch_nodes, "start", maxNodes=4, replicas=4)
    wait_until(lambda: len(jobs.plan_nodes("start")) == 4, timeout=20,
               what="generation 1 to use all 4 nodes")
    plan = jobs.plan("start")
    assert plan["generation"] == 1 and plan["reason"] == "Initial"
    assert sorted(jobs.plan_nodes("start")) == sorted(made)
    pods = jobs.workers("start")
    assert len(pods) == 4
    # Scheduled by the real scheduler onto the GPU pool, one worker per node.
    assert sorted(p.spec.node_name for p in pods) == sorted(made)
    for p in pods:
        assert p.metadata.owner_references[0].kind == "LazarusJob"
        assert p.spec.containers[0].resources.limits["nvidia.com/gpu"] == "1"
    wait_until(lambda: all(p.metadata.annotations.get("lazarus.dev/plan-generation") == "1"
                           for p in jobs.workers("start")),
               timeout=10, what="every worker annotated with generation 1")
    wait_until(lambda: jobs.status("start").get("readyNodes") == 4, timeout=10,
               what="status.readyNodes = 4")
    ready = jobs.condition("start", "Ready")
    assert ready["status"] == "True" and ready["reason"] == "Running"


def test_deleting_a_node_publishes_a_generation_without_it(cluster, operator, jobs, scratch_nodes):
    made, _ = started(jobs, scratch_nodes, "loss", maxNodes=4, replicas=4)
    jobs.wait_generation("loss", 1)
    wait_until(lambda: len(jobs.plan_nodes("loss")) == 4, timeout=20, what="4 nodes in the plan")
    victim = jobs.plan_nodes("loss")[0]
    faults.delete_node(cluster.core, victim)
    plan = jobs.wait_generation("loss", 2)
    assert plan["reason"] == "NodeLost" and victim not in jobs.plan_nodes("loss")
    assert len(plan["nodes"]) == 3
    wait_until(lambda: jobs.status("loss").get("generation") == 2, timeout=10,
               what="status.generation = 2")
    cond = jobs.condition("loss", "Reconfigured")
    assert cond["reason"] == "NodeLost" and "generation 2" in cond["message"]
    assert jobs.condition("loss", "CheckpointRestored")["status"] == "False"
    wait_until(lambda: any(e.reason == "Reconfigured" and "NodeLost" in e.message
                           for e in jobs.events("loss")),
               timeout=10, what="a Reconfigured Event on the job")
    assert operator.metric("lazarus_reconfigurations_total", job="loss", reason="NodeLost") == 1
    assert operator.metric("lazarus_plan_generation", job="loss") == 2
    table = kubectl(cluster, "get", "lazarusjobs", "-n", jobs.namespace)
    header, row = table.splitlines()[0].split(), table.splitlines()[1].split()
    assert header[:6] == ["NAME", "READY", "TARGET", "GENERATION", "STEP", "MINREPLICAS"]
    assert row[0] == "loss" and row[3] == "2"


def test_spot_notice_replans_before_the_node_is_deleted(cluster, operator, jobs, scratch_nodes):
    started(jobs, scratch_nodes, "notice", maxNodes=4, replicas=4)
    wait_until(lambda: len(jobs.plan_nodes("notice")) == 4, timeout=20, what="4 nodes in the plan")
    doomed = jobs.plan_nodes("notice")[1]
    faults.spot_notice(cluster.core, doomed, "karpenter")
    plan = jobs.wait_generation("notice", 2)
    # The node still exists: the job moved off it during the notice period.
    assert cluster.core.read_node(doomed).metadata.deletion_timestamp is None
    assert plan["reason"] == "SpotNotice" and doomed not in jobs.plan_nodes("notice")
    faults.delete_node(cluster.core, doomed)
    settle(3)
    assert jobs.generation("notice") == 2  # the reclaim itself costs no reconfiguration


@pytest.mark.parametrize("outcome", ["recoverable", "unrecoverable"])
def test_two_nodes_lost_at_once(cluster, operator, jobs, scratch_nodes, outcome):
    # 6 nodes x 2 slots for 5 experts with f=1: replica counts 2,2,2,3,3, so some pairs of
    # nodes hold every replica of an expert and others do not; MRO nests them so that few do.
    started(jobs, scratch_nodes, "pair", nodes=6, zones=1, maxNodes=6, replicas=6, minNodes=3,
            minReplicas=1, slotsPerGpu=2, runtime={"experts": 5, "layers": 2})
    wait_until(lambda: len(jobs.plan_nodes("pair")) == 6, timeout=20, what="6 nodes in the plan")
    plan = jobs.plan("pair")
    holders = [{plan["nodes"][i]["name"] for i, slots in enumerate(layer["placement"]) if e in slots}
               for layer in plan["layers"] for e in range(plan["experts"])]
    pairs = list(itertools.combinations(jobs.plan_nodes("pair"), 2))
    fatal = [p for p in pairs if any(h <= set(p) for h in holders)]
    # MRO's own figure: the share of pairs that leave every expert a replica.
    assert abs((1 - len(fatal) / len(pairs)) - plan["recovery"]["2"]) < 1e-9
    assert 0 < len(fatal) < len(pairs)
    pair = fatal[0] if outcome == "unrecoverable" else next(p for p in pairs if p not in fatal)
    for node in pair:
        faults.delete_node(cluster.core, node)
    new = jobs.wait_generation("pair", 2)
    assert not set(pair) & set(jobs.plan_nodes("pair"))
    # No coordinator runs in this tier; the operator forecasts nothing: the restore is
    # reported only once the coordinator says it happened, in its progress report (written
    # here as the coordinator would, into the job's state ConfigMap).
    assert jobs.condition("pair", "CheckpointRestored").get("status") != "True"
    restored = 5 if outcome == "unrecoverable" else None
    report = Progress(step=6, generation=new["generation"], checkpoint_step=5,
                      restored_step=restored, experts_lost=1 if restored else 0,
                      experts_migrated=0 if restored else 3, restores=1 if restored else 0)
    report_progress(jobs, "pair", report)
    wait_until(lambda: jobs.status("pair").get("step") == 6, timeout=10,
               what="the progress report to reach the status")
    if outcome == "recoverable":
        assert jobs.condition("pair", "CheckpointRestored")["status"] == "False"
        assert "fetched 3 expert replicas" in jobs.condition("pair", "Reconfigured")["message"]
        assert operator.metric("lazarus_checkpoint_restores_total", job="pair") == 0
        assert operator.metric("lazarus_experts_migrated_total", job="pair") == 3
    else:
        wait_until(lambda: jobs.condition("pair", "CheckpointRestored").get("status") == "True",
                   timeout=10, what="the CheckpointRestored condition")
        assert jobs.condition("pair", "CheckpointRestored")["reason"] == "ExpertsLost"
        assert jobs.status("pair")["checkpointRestores"] == 1
        assert operator.metric("lazarus_checkpoint_restores_total", job="pair") == 1
        wait_until(lambda: any(e.reason == "CheckpointRestore" for e in jobs.events("pair")),
                   timeout=10, what="a CheckpointRestore Event")


def test_growth_to_max_nodes_and_kubectl_scale(cluster, operator, jobs, scratch_nodes):
    scratch_nodes("gpu-spot", num_zones=1, nodes_per_zone=2)
    jobs.create(make_job("grow", jobs.namespace, minNodes=2, maxNodes=4, replicas=4,
                         minReplicas=1))
    # Only 2 nodes exist: after the start grace the job runs on them, 2 workers pending.
    jobs.wait_generation("grow", 1)
    assert len(jobs.plan_nodes("grow")) == 2
    assert len(jobs.workers("grow")) == 4
    scratch_nodes("gpu-spot", num_zones=1, nodes_per_zone=3)  # capacity arrives, one too many
    plan = wait_until(lambda: (p := jobs.plan("grow")) and len(p["nodes"]) == 4 and p,
                      timeout=30, what="the job to grow to 4 nodes")
    assert plan["reason"] == "NodeJoined"
    settle(2)
    assert len(jobs.plan_nodes("grow")) == 4 and len(jobs.workers("grow")) == 4  # maxNodes
    kubectl(cluster, "scale", "lazarusjob/grow", "--replicas=3", "-n", jobs.namespace)
    wait_until(lambda: len(jobs.plan_nodes("grow")) == 3, timeout=20, what="scale down to 3")
    assert jobs.plan("grow")["reason"] == "ScaleDown"
    wait_until(lambda: len(jobs.workers("grow")) == 3, timeout=20, what="3 worker pods")
    kubectl(cluster, "scale", "lazarusjob/grow", "--replicas=4", "-n", jobs.namespace)
    wait_until(lambda: len(jobs.plan_nodes("grow")) == 4, timeout=30, what="scale up to 4")
    scale = json.loads(kubectl(cluster, "get", "--raw",
                               f"/apis/lazarus.dev/v1alpha1/namespaces/{jobs.namespace}"
                               "/lazarusjobs/grow/scale"))
    assert scale["spec"]["replicas"] == 4
    wait_until(lambda: jobs.status("grow").get("readyNodes") == 4, timeout=10,
               what="status.readyNodes (the scale status) = 4")


def test_operator_killed_mid_reconfiguration_converges(cluster, operator, jobs, scratch_nodes):
    started(jobs, scratch_nodes, "crash", nodes=6, zones=2, maxNodes=6, replicas=6,
            minReplicas=1)
    wait_until(lambda: len(jobs.plan_nodes("crash")) == 6, timeout=20, what="6 nodes in the plan")
    # 1. Killed before it sees the failure: the restart re-derives the change from the plan
    #    ConfigMap and the cluster, and publishes exactly the next generation.
    operator.kill()
    first = jobs.plan_nodes("crash")[0]
    faults.delete_node(cluster.core, first)
    operator.start()
    jobs.wait_generation("crash", 2)
    assert first not in jobs.plan_nodes("crash")
    # 2. Killed right after publishing, before it replaced the worker or wrote the status.
    second = jobs.plan_nodes("crash")[0]
    faults.delete_node(cluster.core, second)
    wait_until(lambda: jobs.generation("crash") >= 3, timeout=30, interval=0.01,
               what="generation 3")
    operator.kill()
    operator.start()
    wait_until(lambda: jobs.status("crash").get("generation") == 3, timeout=20,
               what="status.generation to converge to 3")
    settle(3)
    assert jobs.generation("crash") == 3  # no generation lost, none invented
    assert second not in jobs.plan_nodes("crash")
    pods = jobs.workers("crash")
    names = [p.metadata.name for p in pods]
    assert len(names) == len(set(names)) and len(pods) <= 6  # no duplicate workers
    published = sorted(int(e.message.split()[1]) for e in jobs.events("crash")
                       if e.reason in ("PlanPublished", "Reconfigured"))
    assert published == [1, 2, 3]


def test_deleting_the_job_leaves_no_orphans(cluster, operator, jobs, scratch_nodes):
    started(jobs, scratch_nodes, "gone", nodes=2, zones=1, maxNodes=2, replicas=2)
    # No finalizer: a job never outlives the operator, nor blocks its namespace's deletion.
    assert not jobs.get("gone")["metadata"].get("finalizers")
    jobs.custom.delete_namespaced_custom_object("lazarus.dev", "v1alpha1", jobs.namespace,
                                                "lazarusjobs", "gone",
                                                propagation_policy="Background")
    core = cluster.core
    wait_until(lambda: not jobs.workers("gone") and jobs.plan("gone") is None and not
               core.list_namespaced_service(jobs.namespace, label_selector="lazarus.dev/job=gone").items,
               timeout=30, what="the job's pods, plan ConfigMap and Service to be garbage-collected")


def report_progress(jobs, job: str, progress: Progress) -> None:
    """What the job's coordinator does after a step: write it into the job's state."""
    jobs.core.patch_namespaced_config_map(state_configmap_name(job), jobs.namespace,
                                          {"data": state_configmap_data(progress, {})})


def test_progress_reports_drive_the_step_and_rebalancing(cluster, operator, jobs, scratch_nodes):
    # 6 nodes x 3 slots for 4 experts with f=2: no node holds every expert, so skewed loads
    # show on the ranks (1.32 times the mean), and there is room for replicas to follow
    # them (1.05). With every expert on every node the ranks stay equal under any loads,
    # and nothing is worth a rebalance.
    started(jobs, scratch_nodes, "steps", nodes=6, zones=2, maxNodes=6, replicas=6,
            slotsPerGpu=3, rebalanceEverySteps=10, rebalanceMinGainPercent=10)
    wait_until(lambda: len(jobs.plan_nodes("steps")) == 6, timeout=20, what="6 nodes in the plan")
    report_progress(jobs, "steps", Progress(step=5, generation=1, checkpoint_step=5,
                                            loads=((10, 10, 10, 10), (10, 10, 10, 10))))
    wait_until(lambda: jobs.status("steps").get("step") == 5, timeout=10, what="status.step = 5")
    assert jobs.status("steps")["checkpointStep"] == 5 and jobs.generation("steps") == 1
    # Skewed loads at the rebalance interval: replicas follow the load at the step boundary.
    report_progress(jobs, "steps", Progress(step=10, generation=1,
                                            loads=((70, 10, 10, 10), (10, 10, 10, 70))))
    plan = jobs.wait_generation("steps", 2)
    assert plan["reason"] == "Rebalance"
    assert plan["layers"][0]["replicas"][0] > plan["layers"][0]["replicas"][1]
    assert plan["layers"][1]["replicas"][3] > plan["layers"][1]["replicas"][0]
    assert min(min(layer["replicas"]) for layer in plan["layers"]) >= 2  # f still holds


def _peering_active(op) -> bool:
    """kopf starts paused and logs each change: the last such line says where it stands."""
    lines = [l for l in op.log_text().splitlines()
             if "Resuming operations after the pause" in l or "Pausing operations in favour" in l]
    return bool(lines) and "Resuming" in lines[-1]


def test_a_second_replica_stands_by_and_takes_over(cluster, namespace, operator_factory, jobs,
                                                   scratch_nodes):
    from kubernetes import client

    client.CustomObjectsApi(cluster.api).create_namespaced_custom_object(
        "kopf.dev", "v1", namespace, "kopfpeerings", {
            "apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "lazarus"}})
    first = operator_factory(peering="lazarus").start()
    second = operator_factory(peering="lazarus").start()
    made, _ = started(jobs, scratch_nodes, "ha", nodes=4, zones=2, maxNodes=4, replicas=4)
    wait_until(lambda: len(jobs.plan_nodes("ha")) == 4, timeout=20, what="4 nodes in the plan")
    # Exactly one replica acts; the other stays paused in its favour.
    active = wait_until(lambda: (act := [op for op in (first, second) if _peering_active(op)])
                        and len(act) == 1 and act[0], timeout=30,
                        what="exactly one active replica")
    active.kill()
    victim = jobs.plan_nodes("ha")[0]
    faults.delete_node(cluster.core, victim)
    jobs.wait_generation("ha", 2, timeout=60)  # the standby resumes and re-plans
    assert victim not in jobs.plan_nodes("ha")
    # The two replicas never both acted: one snapshot of the workers holds no more than the
    # target, and no two of them on one node (each was created by one operator, once).
    pods = jobs.workers("ha")
    assert len(pods) <= 4
    placed = [p.spec.node_name for p in pods if p.spec.node_name]
    assert len(set(placed)) == len(placed)
