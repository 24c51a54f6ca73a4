#!/usr/bin/env bash
# The GPU check: on a machine with a CUDA device, run the GPU tests and the GPU benchmarks
# and print one table of the results. It uses the Python that already has torch (python3,
# or $PYTHON); it builds no venv and fetches nothing, so it runs on a bare GPU box.
#
#   hack/gpu-check.sh                  # at most 12 minutes on one H200, likely 6-8
#   GPU_CHECK_OUT=/some/dir hack/gpu-check.sh   # keep the logs and JSON there
#
# Needs torch with CUDA, triton, pytest (with pytest-timeout), numpy, scipy and pyyaml.
# Each part has its own time limit, so one that hangs cannot take the whole budget.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$LAZARUS_ROOT"
py=${PYTHON:-python3}
out=${GPU_CHECK_OUT:-$(mktemp -d)}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

"$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || die "no CUDA device visible to $py's torch; this check needs a GPU"

# The tests that run on CUDA: the gpu-marked ones, and the kernel tests (on CUDA they run
# the compiled Triton kernels instead of the interpreter).
gpu_tests=(tests/runtime/test_gpu_step.py tests/runtime/test_dispatch_kernels.py)

log "GPU tests"
timeout 240 "$py" -m pytest -p no:cacheprovider -q -rfEs "${gpu_tests[@]}" \
  2>&1 | tee "$out/tests.log"
tests_rc=${PIPESTATUS[0]}

log "token-dispatch kernels"
timeout 90 "$py" benchmarks/bench_dispatch_kernels.py --json "$out/kernels.json" \
  2>&1 | tee "$out/kernels.log"

# gpt-l first: its 32K row is the one the targets are about. Rows are written as each
# model finishes, so a run cut by the time limit keeps what it measured.
log "training step"
timeout 390 "$py" benchmarks/bench_train_step.py --models gpt-l,gpt-s --compile dense \
  --warmup 2 --steps 4 --json "$out/train.json" 2>&1 | tee "$out/train.log"

"$py" - "$out" <<'EOF'
import json, re, sys
from pathlib import Path

import torch

out = Path(sys.argv[1])
rows = []
summary = re.findall(r"^=*\s*(.*(?:passed|failed|error|skipped).*?)\s*=*$",
                     (out / "tests.log").read_text(), re.M)
rows.append(("GPU tests", summary[-1] if summary else "did not finish (see tests.log)"))
if (out / "kernels.json").exists():
    for r in json.loads((out / "kernels.json").read_text()):
        if r["impl"] == "triton":
            rows.append((f"{r['op']} {r['shape']}, of copy_ (>= 0.70)", f"{r['of_copy']:.2f}"))
else:
    rows.append(("token-dispatch kernels", "did not finish (see kernels.log)"))
if (out / "train.json").exists():
    for r in json.loads((out / "train.json").read_text()):
        ratio = f"{r['per_compiled']:.2f}" if r["per_compiled"] is not None else "-"
        rows.append((f"{r['model']} {r['tokens']} tokens, {r['impl']}",
                     f"{r['seconds'] * 1e3:.0f} ms, MFU {r['mfu']}, {r['peak_bytes'] / 2**30:.1f} GiB, "
                     f"{r['host_syncs']} syncs, {ratio} x compiled plain"))
else:
    rows.append(("training step", "did not finish (see train.log)"))
width = max(len(what) for what, _ in rows)
print(f"\nGPU check on {torch.cuda.get_device_name()}, torch {torch.__version__} "
      f"(logs in {out})")
print(f"{'what':<{width}}  result")
for what, result in rows:
    print(f"{what:<{width}}  {result}")
EOF
exit "$tests_rc"
