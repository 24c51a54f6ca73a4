# Shared by the hack/ scripts: where cached tools live, and the Python environment.
# Everything heavy is cached outside the checkout, keyed by what it was built from,
# so a second run (or a second clone on the same machine) reuses it.
LAZARUS_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LAZARUS_CACHE="${LAZARUS_CACHE:-$HOME/.cache/lazarus}"
# The cached venv is shared by every clone on the machine; its editable install points at
# one of them. This checkout's packages come first on the path of everything started from
# here (tests, workers, the operator), whichever clone the venv last pointed at; so does
# the test infrastructure (tests/testcluster), which the hack/ scripts and the cluster
# benchmarks drive too.
export PYTHONPATH="$LAZARUS_ROOT/operator:$LAZARUS_ROOT/runtime:$LAZARUS_ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"

log() { printf '[lazarus] %s\n' "$*" >&2; }
die() { printf '[lazarus] error: %s\n' "$*" >&2; exit 1; }
