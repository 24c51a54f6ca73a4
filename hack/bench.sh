#!/usr/bin/env bash
# Run a benchmark script with the project's environment (the cached venv, this checkout's
# packages and the test cluster tooling on the path), e.g.
#   hack/bench.sh benchmarks/bench_operator_replan.py --nodes 2000 --job-nodes 1024
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

[ $# -ge 1 ] || die "usage: hack/bench.sh benchmarks/SCRIPT.py [args...]"
venv=$("$LAZARUS_ROOT/hack/ensure-venv.sh")
export PATH="$venv/bin:$PATH"
exec "$venv/bin/python" "$@"
