#!/usr/bin/env bash
# The kind path, for machines with Docker and a registry: a kind cluster with one worker per
# pool and zone of hack/nodepools.yaml, carrying the pool's labels and taints and advertising
# its fake nvidia.com/gpu capacity, and the same cluster tests run against it.
#
#   hack/kind.sh up               create the cluster, or reuse it; prints its kubeconfig path
#   hack/kind.sh test [ARGS...]   run the cluster tests (pytest -m cluster ARGS) against it
#   hack/kind.sh down             delete the cluster
#
# kind's default node image (Kubernetes 1.37 for kind v0.33.0) is used unless KIND_NODE_IMAGE
# names another. Tests that need kwok (scratch nodes for fault injection) skip themselves.
#
# Not run in CI: kind's nodes run from a kindest/node image, which only a registry serves,
# and none is reachable from our machines; `kind create cluster` then fails at once on the
# pull. README ("With Docker: kind") says what building one here would take.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
source "$LAZARUS_ROOT/hack/control-plane-versions.sh"

KIND_VERSION=0.33.0
kind="$TOOLS_DIR/kind-v$KIND_VERSION/kind"
name=${LAZARUS_KIND_CLUSTER:-lazarus}
kubeconfig="$LAZARUS_CACHE/kind/$name.kubeconfig"

require_docker() {
  command -v docker >/dev/null \
    || die "kind runs its nodes in Docker, and docker is not on PATH. Without Docker, use hack/cluster.sh up (kwok) instead."
  docker info >/dev/null 2>&1 \
    || die "kind needs a running Docker engine, and 'docker info' failed (hack/images.sh engine starts one as root)."
}

ensure_kind() {
  [ -x "$kind" ] && return
  command -v go >/dev/null || die "Go is needed to build kind (https://go.dev/dl/)"
  log "building kind v$KIND_VERSION"
  local start=$SECONDS
  GOTOOLCHAIN=local CGO_ENABLED=0 GOBIN="$(dirname "$kind")" go install "sigs.k8s.io/kind@v$KIND_VERSION"
  log "built kind in $((SECONDS - start)) s"
}

kubectl_bin() {
  if [ -x "$KUBE_BIN_DIR/kubectl" ]; then echo "$KUBE_BIN_DIR/kubectl"
  elif command -v kubectl >/dev/null; then command -v kubectl
  else die "kubectl is needed: install it, or build it with hack/build-control-plane.sh"
  fi
}

up() {
  require_docker
  ensure_kind
  local venv config
  venv=$("$LAZARUS_ROOT/hack/ensure-venv.sh")
  mkdir -p "$(dirname "$kubeconfig")"
  if "$kind" get clusters 2>/dev/null | grep -qx "$name"; then
    log "reusing the kind cluster $name"
    "$kind" export kubeconfig --name "$name" --kubeconfig "$kubeconfig"
  else
    config="$(dirname "$kubeconfig")/$name.config.json"
    "$venv/bin/python" -m testcluster.nodepools kind-config --name "$name" > "$config"
    log "creating the kind cluster $name from $config"
    local start=$SECONDS
    "$kind" create cluster --name "$name" --config "$config" --kubeconfig "$kubeconfig" --wait 5m \
      ${KIND_NODE_IMAGE:+--image "$KIND_NODE_IMAGE"}
    log "created in $((SECONDS - start)) s"
  fi
  # No device plugin runs on kind's nodes, so the GPUs are written into the node status.
  "$venv/bin/python" -m testcluster.nodepools advertise-gpus --kubeconfig "$kubeconfig"
  "$(kubectl_bin)" --kubeconfig "$kubeconfig" wait node --all --for condition=Ready --timeout 5m >/dev/null \
    || die "kind's nodes did not become Ready in 5 minutes; see 'docker logs $name-worker'"
  echo "$kubeconfig"
}

case "${1:-}" in
  up) up ;;
  test)
    shift
    kubeconfig=$(up)
    LAZARUS_TEST_KUBECONFIG="$kubeconfig" exec "$LAZARUS_ROOT/hack/test.sh" -m cluster "$@"
    ;;
  down)
    require_docker
    ensure_kind
    "$kind" delete cluster --name "$name"
    rm -f "$kubeconfig"
    ;;
  *) die "usage: hack/kind.sh up|test|down" ;;
esac
