#!/usr/bin/env bash
# Install the S3-compatible server the checkpoint tests run on 127.0.0.1: moto's server mode
# (moto_server), in a Python environment of its own, cached per version like the control
# plane; a second run takes well under a second. Prints the path of moto_server.
#
# Why moto, and why apart from the project's venv:
# - MinIO, the other candidate, is AGPL-3.0, and this project takes no AGPL modules; its
#   repository is also no longer maintained.
# - moto needs botocore, which needs python-dateutil<3, while kubernetes 37 (operator and
#   coordinator) needs python-dateutil>=3: they cannot share one environment. The server is
#   a process of its own anyway; the tests only speak S3 to it over a socket.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

MOTO_VERSION=5.2.5
# Only moto's S3 backend and the web server of its server mode.
REQUIREMENTS=("moto[s3]==$MOTO_VERSION" "flask==3.1.3" "flask-cors==6.0.5")
TOOLS_DIR="$LAZARUS_CACHE/tools"
dir="$TOOLS_DIR/moto-$MOTO_VERSION"
python=${PYTHON:-python3}

mkdir -p "$TOOLS_DIR"
exec 9>"$TOOLS_DIR/.build-moto.lock"
flock --wait 600 9 || die "another build held $TOOLS_DIR/.build-moto.lock for 10 minutes"
if [ ! -f "$dir/.complete" ]; then
  log "installing moto $MOTO_VERSION (the tests' S3 server) into $dir"
  start=$SECONDS
  rm -rf "$dir"
  # Built in place (a venv's scripts name their interpreter by path); .complete marks a
  # finished install, so an interrupted one is redone.
  if ! out=$("$python" -m venv "$dir" 2>&1 && "$dir/bin/pip" install "${REQUIREMENTS[@]}" 2>&1); then
    printf '%s\n' "$out" >&2
    rm -rf "$dir"
    die "installing moto failed"
  fi
  touch "$dir/.complete"
  log "installed moto in $((SECONDS - start)) s"
fi
echo "$dir/bin/moto_server"
