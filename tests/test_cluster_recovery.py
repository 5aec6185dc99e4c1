"""A cluster client that lost every node finds the cluster again, and says so (issue 26).

The race itself (many commands, a master killed) is a fault scenario
(tests/faults/test_cluster_client_race.py); here the state it leaves behind is made directly,
against redis-py's real classes, so that an upgrade that changes what `RecoveringCluster`
relies on (``nodes_manager.startup_nodes``, ``aclose`` forcing a new slot-map read, the text
of "cannot be connected") fails here first.
"""

from __future__ import annotations

import asyncio
import socket

import pytest
from prometheus_client import generate_latest

from lmqueue.shared.backoff import Backoff
from lmqueue.shared.cluster_client import ClusterUnreachable, RecoveringCluster, cluster_rebuilds
from lmqueue.shared.connections import connect_async_redis
from lmqueue.shared.redis_errors import REDIS_DOWN
from lmqueue.shared.worker_stats import WorkerStats
from lmqueue.status import render_text
from lmqueue.workers.health import HealthState
from lmqueue.workers.metrics import WorkerMetrics


def _dead_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _lose_every_node(client: RecoveringCluster) -> None:
    """What redis-py's cascade leaves: an empty startup list and a client that must re-read."""
    client.nodes_manager.startup_nodes.clear()
    await client.aclose()


@pytest.mark.cluster
async def test_a_cluster_client_that_lost_every_node_rebuilds_from_the_nodes_it_saw(cluster_url):
    client = await connect_async_redis(cluster_url)
    try:
        assert isinstance(client, RecoveringCluster)
        assert len(client.addresses) >= 3  # the masters at least, from the first slot map
        await _lose_every_node(client)
        await client.set("rebuilt", "yes")
        assert await client.get("rebuilt") == b"yes"
        assert (client.rebuilds, client.rebuilding) == (1, False)
        assert cluster_rebuilds(client, client) == (1, False)  # one client counted once
    finally:
        await client.aclose()


@pytest.mark.cluster
async def test_a_rebuild_that_reaches_no_node_is_a_retryable_error_and_is_spaced(cluster_url):
    client = await connect_async_redis(cluster_url)
    known = dict(client.addresses)
    dead = _dead_port()
    try:
        client.addresses = {f"127.0.0.1:{dead}": ("127.0.0.1", dead)}
        await _lose_every_node(client)
        with pytest.raises(ClusterUnreachable) as raised:
            await client.get("x")
        assert isinstance(raised.value, REDIS_DOWN)  # every retry loop of lmqueue takes it
        assert (client.rebuilds, client.rebuilding) == (1, True)
        assert cluster_rebuilds(client) == (1, True)
        client.addresses.update(known)
        with pytest.raises(ClusterUnreachable, match="next in"):  # within the backoff: no dial
            await client.get("x")
        await asyncio.sleep(0.1)
        assert await client.get("x") is None
        assert (client.rebuilds, client.rebuilding) == (1, False)  # one episode, ended
    finally:
        await client.aclose()


async def test_a_plain_client_has_no_rebuilds(redis_url):
    client = await connect_async_redis(redis_url)
    try:
        assert cluster_rebuilds(client, None) == (0, False)
    finally:
        await client.aclose()


def test_backoff_doubles_to_its_ceiling_and_a_success_resets_it():
    backoff = Backoff(first_s=0.05, max_s=0.3)
    assert not backoff.failing and not backoff.reset()
    assert [backoff.delay_s() for _ in range(5)] == [0.05, 0.1, 0.2, 0.3, 0.3]
    assert backoff.failing and backoff.failures == 5
    assert backoff.reset() and not backoff.failing
    assert backoff.delay_s() == 0.05


def test_a_worker_rebuilding_its_cluster_client_is_not_ready_and_exports_it():
    state = {"value": (0, False)}
    health = HealthState(clock=lambda: 100.0)
    health.mark_published()
    health.watch_cluster(lambda: state["value"])
    metrics = WorkerMetrics("m", process_metrics=False)
    metrics.watch_cluster(lambda: state["value"])
    assert health.readiness() == (True, "ready")
    state["value"] = (2, True)
    ready, why = health.readiness()
    assert not ready and "rebuilding the Redis Cluster connection" in why
    text = generate_latest(metrics.registry).decode()
    assert 'lmq_cluster_rebuilds_total{model="m"} 2.0' in text
    assert 'lmq_cluster_rebuilding{model="m"} 1.0' in text
    state["value"] = (2, False)
    assert health.readiness() == (True, "ready")
    assert 'lmq_cluster_rebuilding{model="m"} 0.0' in generate_latest(metrics.registry).decode()


def test_lmq_status_names_workers_whose_cluster_client_was_rebuilt():
    stats = WorkerStats("m", cluster_rebuilds=3, cluster_rebuilt_ms=90_000)
    assert WorkerStats.from_fields(stats.to_fields()) == stats
    worker = {"heartbeat_age_s": 0.5, "cluster_rebuilds": 3, "cluster_rebuilt_ms": 90_000}
    quiet = {"heartbeat_age_s": 0.5, "cluster_rebuilds": 0, "cluster_rebuilt_ms": 0}
    memory = {"used_memory_bytes": 1, "maxmemory_bytes": 0, "maxmemory_policy": "noeviction",
              "evicted_keys": 0, "hit_rate": None}  # fmt: skip
    status = {
        "time_ms": 100_000, "queue": memory, "cache": memory, "cluster_rebuilds": 1,
        "models": {"m": {"backlog": 0, "tenants": {}, "workers": {"w0": worker, "w1": quiet}}},
    }  # fmt: skip
    text = render_text(status)
    assert "w0: Redis Cluster client rebuilt 3x, last 10.0s ago" in text
    assert "w1: Redis Cluster" not in text
    assert "this connection: Redis Cluster client rebuilt 1x" in text
