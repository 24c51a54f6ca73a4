#!/usr/bin/env bash
# Make (or reuse) the Python environment with every pinned dependency, and install this
# checkout into it in editable mode. Prints the venv path on stdout.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

python=${PYTHON:-python3}
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || die "Python 3.10+ is needed (found $("$python" --version 2>&1)); set PYTHON=/path/to/python3.x"

# pip's output (and setuptools' warnings) only matter when it fails.
quietly() {
  local out
  if ! out=$("$@" 2>&1); then
    printf '%s\n' "$out" >&2
    die "failed: $*"
  fi
}

# The dependency set is keyed by pyproject.toml, so editing a pin makes a new venv.
key=$( { "$python" --version; cat "$LAZARUS_ROOT/pyproject.toml"; } | sha256sum | cut -c1-12)
venv="$LAZARUS_CACHE/venv-$key"

if [ ! -f "$venv/.complete" ]; then
  log "creating Python environment $venv (first run downloads torch; a few minutes)"
  start=$SECONDS
  rm -rf "$venv"
  mkdir -p "$LAZARUS_CACHE"
  "$python" -m venv "$venv"
  quietly "$venv/bin/pip" install --upgrade pip setuptools wheel
  quietly "$venv/bin/pip" install -e "$LAZARUS_ROOT[operator,runtime,sim,test]"
  touch "$venv/.complete"
  log "Python environment ready in $((SECONDS - start)) s"
fi

# The venv may be shared by several clones: point its editable install at this one.
if [ "$(cat "$venv/.source" 2>/dev/null)" != "$LAZARUS_ROOT" ]; then
  quietly "$venv/bin/pip" install --no-deps --no-build-isolation -e "$LAZARUS_ROOT"
  echo "$LAZARUS_ROOT" > "$venv/.source"
fi
echo "$venv"
