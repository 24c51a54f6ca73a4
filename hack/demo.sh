#!/usr/bin/env bash
# The quick-start demo: a tiny MoE job on 4 local worker processes, two of which are
# SIGKILLed mid-training and one replaced later (the newcomer gets its experts from the
# survivors); then the same job without failures, and the two loss curves side by side.
# Extra arguments go to the faulty run, e.g. `hack/demo.sh --kill 8:2`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

venv=$("$LAZARUS_ROOT/hack/ensure-venv.sh")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
job="$LAZARUS_ROOT/examples/tiny-cpu.yaml"
common=(run "$job" --local --workers 4 --steps 40)

log "training with failures: worker SIGKILLs as steps 12 and 25 begin, a worker back at 32"
"$venv/bin/lazarus" "${common[@]}" --kill 12:1,25:1 --join 32:1 \
    --summary-json "$out/failures.json" "$@"
echo
log "the same job without failures, for comparison (about 20 s)"
"$venv/bin/lazarus" "${common[@]}" --summary-json "$out/reference.json" > /dev/null 2>&1
"$venv/bin/python" "$LAZARUS_ROOT/hack/compare_losses.py" "$out/failures.json" "$out/reference.json"
