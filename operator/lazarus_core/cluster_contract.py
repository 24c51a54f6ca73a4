"""Names shared by the operator and the runtime's coordinator pod on Kubernetes.

The operator publishes plans in a ConfigMap and reads progress from a pod annotation; the
coordinator reads the one and writes the other. Both sides take the keys from here.
"""
GROUP = "lazarus.dev"
JOB_LABEL = f"{GROUP}/job"
ROLE_LABEL = f"{GROUP}/role"
# The plan ConfigMap's keys: the latest generation, the nodes out of it that still send
# experts away (spot notice), and the checkpoint to restore when experts were lost.
PLAN_KEY = "plan.json"
DRAINING_KEY = "draining.json"
RESTORE_KEY = "restore.json"
# JSON {step, generation, loads, checkpointStep} on the pod of rank 0.
PROGRESS_ANNOTATION = f"{GROUP}/progress"
