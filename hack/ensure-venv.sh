#!/usr/bin/env bash
# Make (or reuse) the Python environment with every pinned dependency, and install this
# checkout into it in editable mode. Prints the venv path on stdout.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

python=${PYTHON:-python3}
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || die "Python 3.11+ is needed (found $("$python" --version 2>&1)); set PYTHON=/path/to/python3.x"

# pip's output (and setuptools' warnings) only matter when it fails.
quietly() {
  local out
  if ! out=$("$@" 2>&1); then
    printf '%s\n' "$out" >&2
    die "failed: $*"
  fi
}

# Keyed by the Python version and the declared dependencies: editing a pin makes a new
# venv, editing anything else in pyproject.toml does not.
key=$("$python" - "$LAZARUS_ROOT/pyproject.toml" <<'PY' | sha256sum | cut -c1-12
import json, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
print(sys.version_info[:2], json.dumps([project.get("dependencies"),
                                        project.get("optional-dependencies")], sort_keys=True))
PY
)
venv="$LAZARUS_CACHE/venv-$key"
mkdir -p "$LAZARUS_CACHE"
# Two runs at once (a test and a benchmark, two clones) must not build the same venv twice.
exec 9>"$LAZARUS_CACHE/venv.lock"
flock 9

if [ ! -f "$venv/.complete" ]; then
  log "creating Python environment $venv (first run downloads torch; a few minutes)"
  start=$SECONDS
  rm -rf "$venv"
  "$python" -m venv "$venv"
  quietly "$venv/bin/pip" install --upgrade pip setuptools wheel
  quietly "$venv/bin/pip" install -e "$LAZARUS_ROOT[operator,runtime,sim,test]"
  touch "$venv/.complete"
  log "Python environment ready in $((SECONDS - start)) s"
fi

# The venv may be shared by several clones: point its editable install (and its console
# scripts, which pyproject.toml names) at this one, again whenever pyproject.toml changes.
source_id="$LAZARUS_ROOT $(sha256sum "$LAZARUS_ROOT/pyproject.toml" | cut -c1-12)"
if [ "$(cat "$venv/.source" 2>/dev/null)" != "$source_id" ]; then
  quietly "$venv/bin/pip" install --no-deps --no-build-isolation -e "$LAZARUS_ROOT"
  echo "$source_id" > "$venv/.source"
fi
# Bytecode for this checkout's packages (an editable install is not compiled): where
# PYTHONDONTWRITEBYTECODE is set, as on our machines, every `lazarus` process compiled ~50
# modules again, 60-80 ms of `lazarus plan` at 4,096 GPUs. Only changed files are compiled
# (50 ms when none is).
quietly "$venv/bin/python" -m compileall -q "$LAZARUS_ROOT/operator" "$LAZARUS_ROOT/runtime"
echo "$venv"
