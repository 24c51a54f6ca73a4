#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what is missing (cached), then runs
# pytest. Extra arguments go to pytest, e.g. `hack/test.sh tests/unit -x`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

venv=$("$LAZARUS_ROOT/hack/ensure-venv.sh")
cd "$LAZARUS_ROOT"
exec "$venv/bin/python" -m pytest "$@"
