#!/usr/bin/env bash
# Inject a fault into the test cluster from the shell: delete a node, give it a spot
# termination notice, make it NotReady, evict a pod, or take a zone down. The same injectors
# the tests use (tests/testcluster/faults.py). `hack/fault.sh --help` lists them.
#
# It targets LAZARUS_TEST_KUBECONFIG when set (a kind or real cluster), else the local cluster.
# Examples:
#   hack/fault.sh spot-notice gpu-spot-us-east-1a-0 --style karpenter
#   hack/fault.sh zone-down us-east-1b
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

kubeconfig=${LAZARUS_TEST_KUBECONFIG:-$("$LAZARUS_ROOT/hack/cluster.sh" kubeconfig)}
venv=$("$LAZARUS_ROOT/hack/ensure-venv.sh")
exec "$venv/bin/python" -m testcluster.faults --kubeconfig "$kubeconfig" "$@"
