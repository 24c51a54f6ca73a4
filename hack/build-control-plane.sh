#!/usr/bin/env bash
# Build the local control plane (kube-apiserver, kube-controller-manager, kube-scheduler,
# kubectl, etcd, kwok, kwokctl) and helm from the Go module proxy, the only source of binaries
# our machines reach. Results are cached per tool and version (hack/control-plane-versions.sh);
# only missing tools are built, so a second run takes well under a second.
#
# A cold build takes tens of minutes on 2 cores, so it runs under `nice`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
source "$LAZARUS_ROOT/hack/control-plane-versions.sh"

command -v go >/dev/null || die "Go is needed to build the control plane (https://go.dev/dl/)"
# Every pinned module accepts the machine's Go 1.26; never download a toolchain behind our back.
export GOTOOLCHAIN=local CGO_ENABLED=0
export GOFLAGS="-trimpath -buildvcs=false"

complete() {  # complete DIR BINARY... : every binary is already built
  local dir=$1; shift
  for b in "$@"; do [ -x "$dir/$b" ] || return 1; done
}

# Builds go into a scratch directory that is renamed into place at the end, so an interrupted
# build never leaves a half-filled cache directory behind.
build() {  # build NAME DIR BUILD_FUNCTION BINARY...
  local name=$1 dir=$2 fn=$3; shift 3
  if complete "$dir" "$@"; then return; fi
  log "building $name into $dir (cold: several minutes on 2 cores)"
  local start=$SECONDS work
  work=$(mktemp -d "$TOOLS_DIR/.build-$name.XXXXXX")
  mkdir -p "$work/bin"
  ( cd "$work" && "$fn" "$work/bin" ) || { rm -rf "$work"; die "building $name failed"; }
  rm -rf "$dir"
  mv "$work/bin" "$dir"
  rm -rf "$work"
  log "built $name in $((SECONDS - start)) s"
}

# `go install k8s.io/kubernetes/cmd/...@v1.x` refuses: kubernetes' go.mod replaces its staging
# modules (k8s.io/api, client-go, ...) with local paths at v0.0.0. A wrapper module requires
# kubernetes and points each staging module at its published v0.<minor>.<patch> instead. The
# list is read from kubernetes' own go.mod, so it stays right for any version.
build_kubernetes() {
  local out=$1 staging_version="v0.${KUBE_VERSION#1.}" gomod minor=${KUBE_VERSION#1.}
  minor=${minor%%.*}
  go mod init lazarus.local/build-kubernetes 2>/dev/null
  go mod edit -require="k8s.io/kubernetes@v$KUBE_VERSION"
  gomod=$(go mod download -json "k8s.io/kubernetes@v$KUBE_VERSION" | sed -n 's/^\s*"GoMod": "\(.*\)",\?$/\1/p')
  [ -f "$gomod" ] || die "could not download k8s.io/kubernetes@v$KUBE_VERSION"
  awk '$1 ~ /^k8s\.io\// && $2 == "v0.0.0" { print $1 }' "$gomod" | while read -r module; do
    go mod edit -replace="$module=$module@$staging_version"
  done
  # kwokctl reads `--version` to pick each component's flags, so stamp the real version in.
  local ldflags="-s -w" pkg
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=v$KUBE_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitTreeState=clean"
  done
  # -mod=mod only fills in go.sum: every package comes from a module kubernetes already pins,
  # so Go picks exactly the dependency versions kubernetes is released with.
  nice go build -mod=mod -ldflags "$ldflags" -o "$out/" \
    "${KUBE_BINARIES[@]/#/k8s.io/kubernetes/cmd/}"
}

# etcd's server module also replaces its sibling modules with local paths.
build_etcd() {
  go mod init lazarus.local/build-etcd 2>/dev/null
  go mod edit -require="go.etcd.io/etcd/server/v3@v$ETCD_VERSION"
  nice go build -mod=mod -ldflags "-s -w" -o "$1/etcd" go.etcd.io/etcd/server/v3
}

build_kwok() {
  GOBIN=$1 nice go install -ldflags "-s -w" \
    "sigs.k8s.io/kwok/cmd/kwok@v$KWOK_VERSION" "sigs.k8s.io/kwok/cmd/kwokctl@v$KWOK_VERSION"
}

build_helm() {
  GOBIN=$1 nice go install -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=v$HELM_VERSION" \
    "helm.sh/helm/v3/cmd/helm@v$HELM_VERSION"
}

mkdir -p "$TOOLS_DIR"
# Concurrent test runs on one machine wait for a single build instead of racing.
exec 9>"$TOOLS_DIR/.build.lock"
flock --wait 3600 9 || die "another build held $TOOLS_DIR/.build.lock for an hour"
start=$SECONDS
build "kubernetes-v$KUBE_VERSION" "$KUBE_BIN_DIR" build_kubernetes "${KUBE_BINARIES[@]}"
build "etcd-v$ETCD_VERSION" "$ETCD_BIN_DIR" build_etcd etcd
build "kwok-v$KWOK_VERSION" "$KWOK_BIN_DIR" build_kwok kwok kwokctl
build "helm-v$HELM_VERSION" "$HELM_BIN_DIR" build_helm helm
log "control plane binaries ready under $TOOLS_DIR ($((SECONDS - start)) s)"
