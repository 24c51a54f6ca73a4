# Shared by the hack/ scripts: where cached tools live, and the Python environment.
# Everything heavy is cached outside the checkout, keyed by what it was built from,
# so a second run (or a second clone on the same machine) reuses it.
LAZARUS_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LAZARUS_CACHE="${LAZARUS_CACHE:-$HOME/.cache/lazarus}"

log() { printf '[lazarus] %s\n' "$*" >&2; }
die() { printf '[lazarus] error: %s\n' "$*" >&2; exit 1; }
