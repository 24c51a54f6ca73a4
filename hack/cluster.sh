#!/usr/bin/env bash
# The local Kubernetes cluster the tests run against, without Docker: a real etcd,
# kube-apiserver, kube-controller-manager and kube-scheduler (from build-control-plane.sh), with
# RBAC and admission on, run by `kwokctl --runtime binary`. kwok simulates the nodes of
# hack/nodepools.yaml and the status of the pods bound to them.
#
#   hack/cluster.sh up          start the cluster, or reuse it if it is running; prints the
#                               kubeconfig path on stdout (its state lives under $LAZARUS_CACHE)
#   hack/cluster.sh stop        stop the cluster's processes, keeping its state for `up`
#   hack/cluster.sh down        stop the cluster and delete its state
#   hack/cluster.sh status      exit 0 if the cluster is up and serving
#   hack/cluster.sh kubeconfig  print the kubeconfig path
#   hack/cluster.sh logs        print the directory holding the components' logs
#   hack/cluster.sh path        print the cached tools' directories (kubectl, helm, ...) for PATH
#
# LAZARUS_CLUSTER_NAME (default: lazarus) selects the cluster, so a test can run its own.
# LAZARUS_HEARTBEAT_FACTOR (default: 1) slows the nodes' heartbeats down that many times, as
# kwokctl does by default (5) for clusters of thousands of simulated nodes (see ``create``).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
source "$LAZARUS_ROOT/hack/control-plane-versions.sh"

name=${LAZARUS_CLUSTER_NAME:-lazarus}
heartbeat_factor=${LAZARUS_HEARTBEAT_FACTOR:-1}
[[ $heartbeat_factor =~ ^[1-9][0-9]*$ ]] \
  || die "LAZARUS_HEARTBEAT_FACTOR must be a whole number >= 1, got '$heartbeat_factor'"
# kwokctl keeps clusters under ~/.kwok by default; keep ours with the rest of the cache.
export KWOK_WORKDIR="$LAZARUS_CACHE/kwok"
# kwokctl would download kubectl for its own use; give it ours.
export KWOK_KUBECTL_BINARY="$KUBE_BIN_DIR/kubectl"
cluster_dir="$KWOK_WORKDIR/clusters/$name"
kubeconfig="$cluster_dir/kubeconfig.yaml"
# Our own log lines say what is happening; kwokctl's INFO lines only repeat it.
kwokctl=("$KWOK_BIN_DIR/kwokctl" --v WARN)
kubectl=("$KUBE_BIN_DIR/kubectl" --kubeconfig "$kubeconfig" --request-timeout=5s)

healthy() { [ -f "$kubeconfig" ] && "${kubectl[@]}" get --raw /readyz >/dev/null 2>&1; }

# A cluster made before a pin in control-plane-versions.sh changed runs the old binaries; one
# made with another heartbeat factor, other node leases (40 s times the factor).
current() {
  local dir
  for dir in "$KUBE_BIN_DIR" "$ETCD_BIN_DIR" "$KWOK_BIN_DIR"; do
    grep -qF "Binary: $dir/" "$cluster_dir/kwok.yaml" 2>/dev/null || return 1
  done
  grep -qx "  nodeLeaseDurationSeconds: $((40 * heartbeat_factor))" "$cluster_dir/kwok.yaml"
}

create() {
  # --kubeconfig "" keeps kwokctl away from ~/.kube/config; ours is $kubeconfig.
  # kwokctl slows every heartbeat down five-fold for clusters of thousands of nodes (200 s
  # node leases, a node lifecycle controller that looks every 25 s); ours are few, so they
  # get Kubernetes' defaults back: NotReady is seen in seconds, and a restarted kwok takes
  # over the nodes' leases within 40 s. bench_operator_replan.py's 2,000 nodes are not few:
  # on 2 cores kwok then renews their leases too late, and every few seconds some go
  # NotReady for a moment (a pod the operator must replace, and two re-plans, each time).
  "${kwokctl[@]}" create cluster --name "$name" --runtime binary \
    --kube-apiserver-binary "$KUBE_BIN_DIR/kube-apiserver" \
    --kube-controller-manager-binary "$KUBE_BIN_DIR/kube-controller-manager" \
    --kube-scheduler-binary "$KUBE_BIN_DIR/kube-scheduler" \
    --etcd-binary "$ETCD_BIN_DIR/etcd" \
    --kwok-controller-binary "$KWOK_BIN_DIR/kwok" \
    --kube-authorization --kube-admission \
    --config "$LAZARUS_ROOT/hack/kwok-stages.yaml" \
    --heartbeat-factor "$heartbeat_factor" \
    --kubeconfig "" --wait 2m --timeout 3m 9>&-
}

start_cluster() {
  "${kwokctl[@]}" start cluster --name "$name" --wait "$1" --timeout "$1" 9>&- && healthy
}

# Several test sessions (several clones) share one cluster; one of them creates it at a time.
# The components kwokctl starts must not inherit the lock (9>&- below), or they would hold it
# for as long as they run.
lock() {
  mkdir -p "$KWOK_WORKDIR"
  exec 9>"$KWOK_WORKDIR/.lock"
  flock --wait 300 9 || die "another hack/cluster.sh held $KWOK_WORKDIR/.lock for 5 minutes"
}

up() {
  "$LAZARUS_ROOT/hack/build-control-plane.sh"
  lock
  # A cluster (re)started here has a new kwok, which must hold every node's lease before it
  # simulates the node; a running one is used as it is.
  local start=$SECONDS since=0
  if [ -d "$cluster_dir" ] && ! current; then
    log "the cluster $name runs other versions than control-plane-versions.sh pins; recreating it"
    "${kwokctl[@]}" delete cluster --name "$name"
  fi
  if healthy; then
    log "reusing the running cluster $name"
  elif [ -d "$cluster_dir" ]; then
    log "starting the stopped cluster $name"
    since=$(date +%s)
    # After an unclean stop (the machine went down, the processes were killed), the first
    # start sometimes never serves; a second one, after a stop that clears what is left of the
    # first, does, and costs less than recreating the cluster.
    if ! start_cluster 45s && ! { "${kwokctl[@]}" stop cluster --name "$name"; start_cluster 2m; }; then
      log "it did not come back; recreating it"
      "${kwokctl[@]}" delete cluster --name "$name"
      create
    fi
  else
    log "creating the cluster $name (kwokctl --runtime binary, Kubernetes v$KUBE_VERSION)"
    since=$(date +%s)
    create
  fi
  local venv
  venv=$("$LAZARUS_ROOT/hack/ensure-venv.sh")
  "$venv/bin/python" -m testcluster.nodepools apply --kubeconfig "$kubeconfig" --since "$since"
  "${kubectl[@]}" wait node --selector lazarus.dev/pool --for condition=Ready --timeout 60s >/dev/null \
    || die "the simulated nodes did not become Ready in 60 s; see the logs in $cluster_dir/logs"
  log "cluster $name ready in $((SECONDS - start)) s; export KUBECONFIG=$kubeconfig"
  echo "$kubeconfig"
}

case "${1:-}" in
  up) up ;;
  stop)
    lock
    if [ -d "$cluster_dir" ]; then
      # kwok holds a Lease per node; the next kwok (a new identity) would wait for them to
      # expire before it simulates those nodes again. Released now, they are taken at once.
      healthy && "${kubectl[@]}" delete lease --namespace kube-node-lease --all >/dev/null
      "${kwokctl[@]}" stop cluster --name "$name"
      log "cluster $name stopped"
    fi
    ;;
  down)
    lock
    if [ -d "$cluster_dir" ]; then
      "${kwokctl[@]}" delete cluster --name "$name"
      log "cluster $name deleted"
    fi
    ;;
  status) healthy ;;
  kubeconfig) echo "$kubeconfig" ;;
  logs) echo "$cluster_dir/logs" ;;
  path) echo "$KUBE_BIN_DIR:$HELM_BIN_DIR:$KWOK_BIN_DIR:$ETCD_BIN_DIR" ;;
  *) die "usage: hack/cluster.sh up|stop|down|status|kubeconfig|logs|path" ;;
esac
