#!/usr/bin/env bash
# The project's container images, built on this machine from its own files, offline, and
# cached by content like the control plane:
#
#   hack/images.sh build    build what is missing; prints "runtime=IMAGE operator=IMAGE"
#   hack/images.sh engine   start a Docker engine if none answers (as root, installs docker.io)
#
# No registry serves base images here, so the base is made once per machine: Debian bookworm
# with its Python 3.11, from debootstrap, imported with `docker import`. images/Dockerfile (one
# target per image) keeps a public base as its default and builds on ours through its BASE
# argument, named by its image ID: the digest of its content. The images' dependencies are
# exactly the requirements of pyproject.toml
# (images/pins.py reads them): the base's own pip downloads them once into a wheelhouse, which
# is served to the build on the engine's bridge address, with PIP_NO_INDEX, so a build never
# reaches the network.
#
# Each image is tagged with a hash of everything it is built from (base, wheelhouse,
# Dockerfile, sources): an unchanged checkout reuses its images at once; a changed source
# file rebuilds only the layers above the dependencies.
#
# Exit status 3: no Docker engine can run here (not root, and none running); the image
# tests skip on it. Any other failure is an error.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

IMAGES_CACHE="$LAZARUS_CACHE/images"
DEBIAN_SUITE=bookworm
DEBIAN_MIRROR=${LAZARUS_DEBIAN_MIRROR:-http://deb.debian.org/debian}
# python3-venv brings ensurepip, which the Dockerfiles use to make their virtualenv.
BASE_PACKAGES=python3,python3-venv,ca-certificates
IMAGES=(runtime operator)
python=${PYTHON:-python3}  # 3.11+ (tomllib), as for hack/ensure-venv.sh
ENGINE_TIMEOUT_S=60
NO_ENGINE=3

# --- the engine ------------------------------------------------------------------------

engine_up() { docker info >/dev/null 2>&1; }

apt_install() {
  local apt=(apt-get -o DPkg::Lock::Timeout=600 install -y --no-install-recommends)
  log "installing $* with apt-get"
  DEBIAN_FRONTEND=noninteractive "${apt[@]}" "$@" >/dev/null \
    || { apt-get -o DPkg::Lock::Timeout=600 update >/dev/null && DEBIAN_FRONTEND=noninteractive "${apt[@]}" "$@" >/dev/null; } \
    || die "apt-get install $* failed"
}

ensure_engine() {
  engine_up && return
  if [ "$(id -u)" != 0 ]; then
    log "no Docker engine answers, and only root may start one here; start dockerd (or let this user use it)"
    exit $NO_ENGINE
  fi
  mkdir -p "$IMAGES_CACHE"
  exec 8>"$IMAGES_CACHE/.engine.lock"
  flock --wait 300 8 || die "another hack/images.sh held $IMAGES_CACHE/.engine.lock for 5 minutes"
  engine_up && { exec 8>&-; return; }
  command -v dockerd >/dev/null && command -v docker >/dev/null || apt_install docker.io
  log "starting dockerd (log: $IMAGES_CACHE/dockerd.log)"
  # Its own session, no inherited descriptors (the lock above), so it outlives this script
  # and every test that started it, like the local cluster.
  setsid dockerd </dev/null >>"$IMAGES_CACHE/dockerd.log" 2>&1 8>&- &
  local deadline=$((SECONDS + ENGINE_TIMEOUT_S))
  until engine_up; do
    [ $SECONDS -lt $deadline ] || die "dockerd did not answer in $ENGINE_TIMEOUT_S s; see $IMAGES_CACHE/dockerd.log"
    sleep 1
  done
  exec 8>&-
}

image_exists() { docker image inspect "$1" >/dev/null 2>&1; }

# --- the base --------------------------------------------------------------------------

# The recipe: its own text is part of the base's name, so editing it makes a new base.
make_base() {  # make_base TAG
  local rootfs
  command -v debootstrap >/dev/null || apt_install debootstrap
  rootfs=$(mktemp -d "$IMAGES_CACHE/.rootfs.XXXXXX")
  log "debootstrap $DEBIAN_SUITE ($BASE_PACKAGES) from $DEBIAN_MIRROR"
  debootstrap --variant=minbase --include="$BASE_PACKAGES" "$DEBIAN_SUITE" "$rootfs" "$DEBIAN_MIRROR" \
    >"$IMAGES_CACHE/debootstrap.log" 2>&1 \
    || { rm -rf "$rootfs"; die "debootstrap failed; see $IMAGES_CACHE/debootstrap.log"; }
  # What only the build machine needs: package lists and downloaded .debs, docs, logs, and
  # the build machine's name and resolver (the engine provides both to each container).
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/usr/share/doc/* \
    "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/var/log/* \
    "$rootfs"/etc/hostname "$rootfs"/etc/resolv.conf
  tar --numeric-owner -C "$rootfs" -c . \
    | docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' \
      --message "Debian $DEBIAN_SUITE minbase + $BASE_PACKAGES (hack/images.sh)" - "$1" >/dev/null
  rm -rf "$rootfs"
}

base_name() {
  echo "lazarus-base:$DEBIAN_SUITE-$( { declare -f make_base; echo "$DEBIAN_SUITE $BASE_PACKAGES"; } | sha256sum | cut -c1-12)"
}

ensure_base() {
  local tag=$1 start=$SECONDS
  image_exists "$tag" && return
  log "making the base image $tag (once per machine)"
  make_base "$tag"
  log "made $tag in $((SECONDS - start)) s"
}

# --- the wheelhouse ----------------------------------------------------------------------

# Every image's requirements, resolved together so that the images agree on what they share.
pins() { "$python" "$LAZARUS_ROOT/images/pins.py" --build-system "${IMAGES[@]}"; }

wheelhouse_dir() {  # wheelhouse_dir BASE
  echo "$IMAGES_CACHE/wheels/$( { echo "$1"; pins; } | sha256sum | cut -c1-12)"
}

# Downloaded by the base's own Python and pip, so the wheels fit the images' Python and libc.
# The download is the one step that reaches the network: it trusts what this machine trusts
# (its CA bundle is mounted, never copied into an image) and follows its PIP_INDEX_URL.
ensure_wheelhouse() {  # ensure_wheelhouse BASE DIR
  local base=$1 dir=$2 work ca start=$SECONDS
  [ -f "$dir/.complete" ] && return
  work=$(mktemp -d "$IMAGES_CACHE/.wheels.XXXXXX")
  chmod 0755 "$work"
  pins > "$work/requirements.txt"
  ca=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
  local args=(--rm --user "$(id -u):$(id -g)" -e HOME=/tmp -v "$work:/wheels")
  [ -f "$ca" ] && args+=(-v "$ca:/etc/lazarus-host-ca.pem:ro" -e PIP_CERT=/etc/lazarus-host-ca.pem)
  for var in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_TRUSTED_HOST; do
    [ -n "${!var:-}" ] && args+=(-e "$var")
  done
  log "downloading the pinned wheels into $dir (once per machine and pin set)"
  docker run "${args[@]}" "$base" sh -c \
    'python3 -m venv /tmp/venv && /tmp/venv/bin/pip download --disable-pip-version-check --progress-bar off --dest /wheels -r /wheels/requirements.txt' \
    >"$IMAGES_CACHE/wheels.log" 2>&1 \
    || { rm -rf "$work"; die "downloading the wheels failed; see $IMAGES_CACHE/wheels.log"; }
  touch "$work/.complete"
  mkdir -p "$(dirname "$dir")"
  rm -rf "$dir"
  mv "$work" "$dir"
  log "downloaded $(du -sh "$dir" | cut -f1) of wheels in $((SECONDS - start)) s"
}

# The build reaches the wheelhouse through the engine's bridge, on a fixed address: the
# address is part of the build's cache key, so a new one would rebuild every layer.
WHEELS_PORT=${LAZARUS_WHEELS_PORT:-38100}

bridge_address() {
  ip -4 -o addr show docker0 2>/dev/null | awk '{ split($4, a, "/"); print a[1]; exit }'
}

serve_wheels() {  # serve_wheels DIR ADDRESS: serves DIR until this script exits
  "$python" -m http.server "$WHEELS_PORT" --bind "$2" --directory "$1" >/dev/null 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null' EXIT
  local deadline=$((SECONDS + 10))
  until (exec 3<>"/dev/tcp/$2/$WHEELS_PORT") 2>/dev/null; do
    kill -0 $server 2>/dev/null \
      || die "could not serve the wheelhouse on $2:$WHEELS_PORT (in use? set LAZARUS_WHEELS_PORT)"
    [ $SECONDS -lt $deadline ] || die "the wheelhouse server on $2:$WHEELS_PORT did not answer"
    sleep 0.2
  done
}

# --- the images --------------------------------------------------------------------------

# What an image is built from: the files its Dockerfile copies (what .dockerignore lets in),
# as they are in this checkout, committed or not.
context_files() {  # context_files IMAGE
  git -C "$LAZARUS_ROOT" ls-files -co --exclude-standard -- \
      pyproject.toml README.md operator runtime examples images/pins.py images/install-pins.sh images/Dockerfile \
    | while read -r f; do [ -f "$LAZARUS_ROOT/$f" ] && echo "$f"; done | LC_ALL=C sort
}

image_name() {  # image_name IMAGE BASE WHEELHOUSE
  local h
  h=$( { echo "$2 $(basename "$3")"; cd "$LAZARUS_ROOT" && context_files "$1" | xargs -d '\n' sha256sum; } \
       | sha256sum | cut -c1-12)
  echo "lazarus-$1:$h"
}

build_image() {  # build_image IMAGE NAME BASE FIND_LINKS HOST
  local image=$1 name=$2 ctx start=$SECONDS
  ctx=$(mktemp -d "$IMAGES_CACHE/.context.XXXXXX")
  (cd "$LAZARUS_ROOT" && context_files "$image" | tar -c -T - ) | tar -x -C "$ctx"
  log "building $name (log: $IMAGES_CACHE/build-$image.log)"
  # The classic builder: BuildKit would fetch its Dockerfile frontend from a registry.
  DOCKER_BUILDKIT=0 docker build --force-rm --build-arg "BASE=$3" --build-arg PIP_NO_INDEX=1 \
      --build-arg "PIP_FIND_LINKS=$4" --build-arg "PIP_TRUSTED_HOST=$5" -f "$ctx/images/Dockerfile" --target "$image" -t "$name" "$ctx" \
      >"$IMAGES_CACHE/build-$image.log" 2>&1 \
    || { rm -rf "$ctx"; tail -20 "$IMAGES_CACHE/build-$image.log" >&2; die "building $name failed"; }
  rm -rf "$ctx"
  log "built $name in $((SECONDS - start)) s ($(docker image inspect -f '{{.Size}}' "$name" | numfmt --to=iec))"
}

names() {  # names BASE_ID WHEELHOUSE: "runtime=NAME operator=NAME"
  local image out=()
  for image in "${IMAGES[@]}"; do out+=("$image=$(image_name "$image" "$1" "$2")"); done
  echo "${out[*]}"
}

build() {
  local base base_id wheels address image name start=$SECONDS
  ensure_engine
  mkdir -p "$IMAGES_CACHE"
  # One build at a time on a machine (several clones, several test sessions).
  exec 9>"$IMAGES_CACHE/.build.lock"
  flock --wait 3600 9 || die "another hack/images.sh held $IMAGES_CACHE/.build.lock for an hour"
  base=$(base_name)
  ensure_base "$base"
  # The images build FROM the base's ID, the digest of its content, not from its name.
  base_id=$(docker image inspect --format '{{.Id}}' "$base")
  wheels=$(wheelhouse_dir "$base")
  local missing=()
  for image in "${IMAGES[@]}"; do
    name=$(image_name "$image" "$base_id" "$wheels")
    image_exists "$name" || missing+=("$image=$name")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    ensure_wheelhouse "$base" "$wheels"
    address=$(bridge_address)
    [ -n "$address" ] || die "the engine has no docker0 bridge to serve the wheelhouse on"
    serve_wheels "$(dirname "$wheels")" "$address"
    for entry in "${missing[@]}"; do
      build_image "${entry%%=*}" "${entry#*=}" "$base_id" "http://$address:$WHEELS_PORT/$(basename "$wheels")/" "$address"
    done
    log "images ready in $((SECONDS - start)) s"
  fi
  names "$base_id" "$wheels"
}

case "${1:-}" in
  build) build ;;
  engine) ensure_engine ;;
  *) die "usage: hack/images.sh build|engine" ;;
esac
