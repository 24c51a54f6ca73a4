"""A relist of the nodes that began before a node's deletion reached the watch does not
bring the node back."""
import json
from types import SimpleNamespace

from lazarus_operator import builders
from lazarus_operator.cluster_cache import ClusterCache

KEY = ("ns", "j")
UID = "uid-j"


def _worker(node, index, phase="Running"):
    return {"metadata": {"name": f"j-worker-{index}", "uid": f"uid-{index}",
                         "labels": {builders.INDEX_LABEL: str(index)},
                         "ownerReferences": [{"kind": "LazarusJob", "name": "j", "uid": UID}]},
            "spec": {"nodeName": node}, "status": {"phase": phase}}


def _node(name):
    return {"metadata": {"name": name},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


def test_a_relist_of_the_nodes_does_not_undo_a_deletion_the_watch_delivered_meanwhile():
    nodes = {n: _node(n) for n in ("n0", "n1", "n2")}
    cache = ClusterCache(None)

    def list_node(**_):
        page = [nodes[n] for n in sorted(nodes)]  # read before the deletion reached the watch
        cache.node_changed(None, "n1")
        return SimpleNamespace(data=json.dumps({"items": page, "metadata": {}}))

    def list_namespaced_pod(namespace, **_):
        return SimpleNamespace(data=json.dumps({"items": [
            _worker(n, i) for i, n in enumerate(nodes)], "metadata": {}}))

    cache.core = SimpleNamespace(list_node=list_node, list_namespaced_pod=list_namespaced_pod)
    for n in nodes:
        cache.node_changed(nodes[n], n)
    cache.refresh_nodes(cache.pods(KEY, "worker", full=True))
    assert "n1" in cache.gone and "n1" not in cache.nodes
    assert set(cache.nodes) == {"n0", "n2"}
