"""Why a plan generation exists, and how a finished job reads: CamelCase words, as status
conditions and Events want them."""
from __future__ import annotations

INITIAL = "Initial"
NODE_LOST = "NodeLost"
SPOT_NOTICE = "SpotNotice"
NODE_JOINED = "NodeJoined"
REBALANCE = "Rebalance"
SCALE_DOWN = "ScaleDown"
SPEC_CHANGED = "SpecChanged"
# The same nodes again: the workers made no progress for Settings.stall_s (a generation whose
# collectives timed out with every member still alive waits for a newer plan, and nothing
# else would publish one). Workers act on it at once: no step boundary is coming.
STALLED = "Stalled"
# The Ready condition's reason once the job trained spec.steps steps.
SUCCEEDED = "Succeeded"
