"""The job state machine shared by the Kubernetes operator and the local backend.

A backend turns what it sees (workers dying, spot notices, new capacity, progress reports)
into events (``events``), calls ``handle(state, event, now)`` (``transitions``) and carries
out the decisions it gets back (``decisions``): publish a plan generation, release workers,
or wait. The controller owns one decision: which nodes run the job and where the expert
replicas go (``publishing``). What moves and whether a checkpoint is restored is the
coordinator's (``lazarus_core.handover``), because only it sees what the workers hold; the
controller reads what happened from the progress reports and shows it (``status``).

The core does no I/O and reads no clock (``now`` is seconds since the epoch, passed in), so
the same input always gives the same output, and a backend can rebuild the state
(``state``) after a restart from what it stored (the latest plan, the step) plus what it
observes again. This module is the package's public face: backends import from here.
"""
from .decisions import Decision, Outcome, PublishPlan, ReleaseWorkers, Wait
from .events import (Event, GpusBack, GpusLost, NodesJoined, NodesLost, Progress,
                     RebalanceDue, SpecChanged, SpotNotice, Tick, WorkerFailed, observe)
from .reasons import (GPU_LOST, INITIAL, NODE_JOINED, NODE_LOST, REBALANCE, SCALE_DOWN,
                      SPEC_CHANGED, SPOT_NOTICE, STALLED, SUCCEEDED)
from .state import JobState, Settings, new_job
from .status import conditions, lowest_replicas, not_ready, status
from .transitions import handle, handle_all

__all__ = [
    "Decision", "Outcome", "PublishPlan", "ReleaseWorkers", "Wait",
    "Event", "GpusBack", "GpusLost", "NodesJoined", "NodesLost", "Progress", "RebalanceDue",
    "SpecChanged", "SpotNotice", "Tick", "WorkerFailed", "observe",
    "GPU_LOST", "INITIAL", "NODE_JOINED", "NODE_LOST", "REBALANCE", "SCALE_DOWN", "SPEC_CHANGED",
    "SPOT_NOTICE", "STALLED", "SUCCEEDED",
    "JobState", "Settings", "new_job",
    "conditions", "lowest_replicas", "not_ready", "status",
    "handle", "handle_all",
]
