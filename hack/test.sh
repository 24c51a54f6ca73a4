#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what is missing (cached), then runs
# pytest. Extra arguments go to pytest, e.g. `hack/test.sh tests/unit -x`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

venv=$("$LAZARUS_ROOT/hack/ensure-venv.sh")
# The cluster tests start a local control plane (hack/cluster.sh) unless they are pointed at
# another cluster; its binaries are built once per machine (minutes cold, instant when cached).
[ -n "${LAZARUS_TEST_KUBECONFIG:-}" ] || "$LAZARUS_ROOT/hack/build-control-plane.sh"
cd "$LAZARUS_ROOT"
# The venv's tools (lazarus, hadolint) are what the tests run.
export PATH="$venv/bin:$PATH"
exec "$venv/bin/python" -m pytest "$@"
