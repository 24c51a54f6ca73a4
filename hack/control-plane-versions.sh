# Pinned versions of the local control plane and where their binaries are cached.
# Sourced by the hack/ scripts. Each tool gets its own versioned directory, so bumping one pin
# rebuilds only that tool.
#
# Kubernetes 1.36 matches kwok v0.8.0's own client libraries (k8s.io/* v0.36.x), so kwokctl
# knows every flag these binaries take. All four modules build with the machine's Go 1.26.
KUBE_VERSION=1.36.3
ETCD_VERSION=3.6.16
KWOK_VERSION=0.8.0
HELM_VERSION=3.22.0

TOOLS_DIR="$LAZARUS_CACHE/tools"
KUBE_BIN_DIR="$TOOLS_DIR/kubernetes-v$KUBE_VERSION"
ETCD_BIN_DIR="$TOOLS_DIR/etcd-v$ETCD_VERSION"
KWOK_BIN_DIR="$TOOLS_DIR/kwok-v$KWOK_VERSION"
HELM_BIN_DIR="$TOOLS_DIR/helm-v$HELM_VERSION"

KUBE_BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
