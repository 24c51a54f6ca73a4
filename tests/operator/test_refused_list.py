"""The heartbeat's full list of a job's pods and nodes, refused for real by the API server
(an account without the rights): logged, not raised into the heartbeat's thread, and not
tried again before RELIST_S (one refused request per minute, not one per heartbeat)."""
import logging

import pytest
from kubernetes import client

from lazarus_operator.apply import JobRecord
from lazarus_operator.reconciler import RELIST_S, Reconciler

pytestmark = pytest.mark.cluster


def test_a_list_the_api_server_refuses_is_logged_and_waits_a_relist(cluster, namespace, caplog):
    unprivileged = cluster.api_as(f"system:serviceaccount:{namespace}:default")
    key = (namespace, "e2e")
    # The account may not list pods: the API server says so.
    with pytest.raises(client.ApiException) as refused:
        client.CoreV1Api(unprivileged).list_namespaced_pod(namespace)
    assert refused.value.status == 403

    r = Reconciler(unprivileged)
    record = JobRecord()
    with caplog.at_level(logging.WARNING):
        r._resync(key, "uid-e2e", record)
    assert "could not list the job's pods and nodes" in caplog.text
    assert "403" in caplog.text
    assert record.listed_at > 0 and not record.listing.locked()

    caplog.clear()
    r._resync(key, "uid-e2e", record)  # the next heartbeat, within RELIST_S: no request
    assert "could not list" not in caplog.text
    record.listed_at -= RELIST_S
    with caplog.at_level(logging.WARNING):
        r._resync(key, "uid-e2e", record)
    assert "could not list the job's pods and nodes" in caplog.text
