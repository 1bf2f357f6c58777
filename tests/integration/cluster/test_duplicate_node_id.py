"""Two daemons given the same node id (``--node-id "$(hostname)"`` twice on one host): the
second refuses to start and says why; the first keeps its registration."""

from __future__ import annotations

import time

import pytest
from cluster_nodes import cluster_node

from kvfabric.cluster.redis_index import RedisGlobalIndex


def settings(redis_url: str, node_id: str) -> list[str]:
    return cluster_node(redis_url, node_id)


def test_a_second_daemon_with_a_live_node_id_refuses_to_start(redis_server, start_daemon) -> None:
    """Regression: on the old code the second daemon started and took the id over: the
    first one's chunks vanished from the index and its heartbeats failed."""
    first = start_daemon(*settings(redis_server.url, "same-host"))
    index = RedisGlobalIndex(redis_server.url)
    before = index.nodes()
    with pytest.raises(RuntimeError) as failed:
        start_daemon(*settings(redis_server.url, "same-host"))
    message = str(failed.value)
    assert "daemon exited 1" in message
    assert "node id 'same-host' is already registered by a live daemon" in message
    assert "Traceback" not in message
    time.sleep(0.5)  # a few of the first daemon's heartbeats: still its registration
    try:
        assert [(n.node_id, n.epoch) for n in index.nodes()] == [
            (n.node_id, n.epoch) for n in before
        ] and len(before) == 1
    finally:
        index.close()
    assert first.proc is not None and first.proc.poll() is None
