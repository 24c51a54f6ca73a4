"""How clouds label spot capacity: the operator reads it from nodes (spot nodes are used
last and their loss expected) and keeps the coordinator off it."""
from __future__ import annotations

from collections.abc import Mapping

# Every cloud labels spot capacity its own way; any of these marks a node as spot.
SPOT_LABELS = {
    "karpenter.sh/capacity-type": "spot",
    "eks.amazonaws.com/capacityType": "SPOT",
    "cloud.google.com/gke-spot": "true",
    "cloud.google.com/gke-preemptible": "true",
}


def is_spot(labels: Mapping[str, str]) -> bool:
    return any(labels.get(k) == v for k, v in SPOT_LABELS.items())


def not_spot_affinity() -> dict:
    """A node affinity that requires a node none of the clouds' labels marks as spot (NotIn
    also admits nodes without the label: plain on-demand or unlabelled capacity)."""
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": k, "operator": "NotIn", "values": [v]}
            for k, v in sorted(SPOT_LABELS.items())]}]}}}
