"""Prometheus metrics of the operator (served by ``python -m lazarus_operator``)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_JOB = ["namespace", "job"]

RECONFIGURATIONS = Counter(
    "lazarus_reconfigurations_total", "Plan generations published after the first",
    _JOB + ["reason"])
RECONFIGURATION_SECONDS = Histogram(
    "lazarus_reconfiguration_seconds",
    "From observing a change to the new plan being published",
    _JOB, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30))
EXPERTS_MIGRATED = Counter(
    "lazarus_experts_migrated_total",
    "Expert replicas the workers fetched from their peers to adopt a generation (as the "
    "coordinator measured it)", _JOB)
SOLVER_SECONDS = Histogram(
    "lazarus_solver_seconds", "Time in the controller core (placement, migration, recovery)",
    _JOB, buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5))
RECOVERY_PROBABILITY = Gauge(
    "lazarus_recovery_probability",
    "Model-level probability of surviving k simultaneous node failures", _JOB + ["k"])
LOWEST_REPLICAS = Gauge(
    "lazarus_lowest_replicas", "Fewest live replicas of any expert in any layer", _JOB)
CHECKPOINT_RESTORES = Counter(
    "lazarus_checkpoint_restores_total",
    "Generations the workers adopted by restoring a checkpoint because some expert had lost "
    "every replica (as the coordinator measured it)", _JOB)
COORDINATOR_REPLACEMENTS = Counter(
    "lazarus_coordinator_replacements_total",
    "Coordinator pods started because the one before died (its process, pod or node)", _JOB)
CHECKPOINT_WRITE_FAILURES = Counter(
    "lazarus_checkpoint_write_failures_total",
    "Checkpoints skipped because storage refused a write after every retry (training went "
    "on)", _JOB)
CHECKPOINT_HEALTHY = Gauge(
    "lazarus_checkpoint_healthy",
    "1 when the latest checkpoint was written, 0 when it was skipped for a storage fault", _JOB)
PLAN_GENERATION = Gauge("lazarus_plan_generation", "Latest published plan generation", _JOB)
READY_NODES = Gauge("lazarus_ready_nodes", "Nodes of the current plan with a live worker", _JOB)


def forget(namespace: str, job: str) -> None:
    """Drop a deleted job's series so they do not linger at their last value."""
    for metric in (RECOVERY_PROBABILITY, LOWEST_REPLICAS, PLAN_GENERATION, READY_NODES,
                   RECONFIGURATIONS, RECONFIGURATION_SECONDS, EXPERTS_MIGRATED, SOLVER_SECONDS,
                   CHECKPOINT_RESTORES, COORDINATOR_REPLACEMENTS, CHECKPOINT_WRITE_FAILURES,
                   CHECKPOINT_HEALTHY):
        for labels in list(metric._metrics):  # prometheus-client has no public lookup
            if labels[:2] == (namespace, job):
                metric.remove(*labels)
