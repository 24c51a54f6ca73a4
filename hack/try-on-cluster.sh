#!/usr/bin/env bash
# Try Lazarus on a cluster without Docker: examples/tiny-cpu.yaml applied with kubectl to the
# local Kubernetes of hack/cluster.sh. The operator and a local stand-in for the kubelet run on
# this machine, so the pods that kube-scheduler places on kwok's simulated spot nodes are real
# worker processes. In another shell:
#   export KUBECONFIG=$(hack/cluster.sh kubeconfig) PATH=$(hack/cluster.sh path):$PATH
#   kubectl get lazarusjobs -n lazarus-demo -w
#   hack/fault.sh delete-node gpu-spot-us-east-1a-0      # or spot-notice, zone-down ...
# This shell follows the coordinator's log (one JSON line per step and per plan). Ctrl-C
# deletes the job and stops the operator and the kubelet; the cluster keeps running
# (hack/cluster.sh down stops it). The nodes a fault deleted come back with hack/cluster.sh up.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

ns=${LAZARUS_DEMO_NAMESPACE:-lazarus-demo}
venv=$("$LAZARUS_ROOT/hack/ensure-venv.sh")
kubeconfig=$("$LAZARUS_ROOT/hack/cluster.sh" up | tail -1)
export KUBECONFIG=$kubeconfig PATH="$("$LAZARUS_ROOT/hack/cluster.sh" path):$venv/bin:$PATH"
cd "$LAZARUS_ROOT"
work=$(mktemp -d)
pids=()
cleanup() {
  kubectl delete lazarusjob tiny -n "$ns" --ignore-not-found --wait=false >/dev/null 2>&1 || true
  kill "${pids[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
  # Nobody plays the kubelet any more: finish the pods' deletion.
  kubectl delete pods -n "$ns" --all --force --grace-period=0 >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

kubectl apply -f helm/lazarus/crds/ >/dev/null
kubectl create namespace "$ns" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
lazarus-operator --namespace "$ns" --standalone --metrics-port 0 --liveness= \
  --coordinator-port "$port" > "$work/operator.log" 2>&1 &
pids+=($!)
python -m testcluster.kubelet --namespace "$ns" --log-dir "$work/pods" &
pids+=($!)
python -m testcluster.pooljob examples/tiny-cpu.yaml --namespace "$ns" | kubectl apply -f -
log "job tiny applied in namespace $ns; operator log: $work/operator.log"
log "watch it from another shell: kubectl get lazarusjobs -n $ns -w"
coordinator="$work/pods/tiny-coordinator/output.log"
until [ -f "$coordinator" ]; do sleep 0.5; done
tail -F "$coordinator"
