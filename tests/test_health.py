"""`HealthServer` and `HealthState`: probes and metrics over real HTTP requests."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator

import pytest

from lmqueue.workers.health import HealthServer, HealthState
from lmqueue.workers.metrics import WorkerMetrics


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def get(url: str, method: str = "GET", timeout_s: float = 5.0) -> tuple[int, str, bytes]:
    """Status, content type and body of one real HTTP request (errors included)."""
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def served(clock: Clock) -> AsyncIterator[tuple[HealthState, WorkerMetrics, str]]:
    state = HealthState(loop_stale_s=10, heartbeat_stale_s=6, clock=clock)
    metrics = WorkerMetrics("m", process_metrics=False)
    async with HealthServer(state, metrics.registry, loop_answer_s=0.3) as server:
        yield state, metrics, f"http://127.0.0.1:{server.port}"


async def fetch(url: str, method: str = "GET", timeout_s: float = 5.0) -> tuple[int, str, bytes]:
    return await asyncio.to_thread(get, url, method, timeout_s)


async def test_probes_follow_the_workers_phases(served, clock) -> None:
    state, _, base = served
    assert (await fetch(f"{base}/healthz"))[::2] == (503, b"starting\n")
    assert (await fetch(f"{base}/readyz"))[::2] == (503, b"loading\n")
    state.mark_published()
    state.mark_serving()
    assert (await fetch(f"{base}/healthz"))[::2] == (200, b"alive\n")
    assert (await fetch(f"{base}/readyz"))[::2] == (200, b"ready\n")
    state.mark_stopping()
    assert (await fetch(f"{base}/readyz"))[::2] == (503, b"stopping\n")
    assert (await fetch(f"{base}/healthz"))[0] == 200  # draining in-flight work is alive


async def test_a_quiet_read_loop_fails_liveness_and_a_tick_revives_it(served, clock) -> None:
    state, _, base = served
    state.mark_published()
    state.mark_serving()
    clock.now += 5
    state.heartbeat(reached_redis=True)
    clock.now += 5.5  # 10.5 s since the last tick, 5.5 s since the heartbeat
    status, _, body = await fetch(f"{base}/healthz")
    assert (status, body) == (503, b"read loop quiet for 10 s\n")
    state.tick()
    assert (await fetch(f"{base}/healthz"))[0] == 200


async def test_redis_unreachable_fails_readiness_but_not_liveness(served, clock) -> None:
    state, _, base = served
    state.mark_published()
    state.mark_serving()
    for _ in range(4):  # the heartbeat loop runs, but Redis does not answer
        clock.now += 2
        state.tick()
        state.heartbeat(reached_redis=False)
    assert (await fetch(f"{base}/healthz"))[0] == 200
    assert (await fetch(f"{base}/readyz"))[::2] == (503, b"no heartbeat reached Redis for 8 s\n")
    state.heartbeat(reached_redis=True)
    assert (await fetch(f"{base}/readyz"))[0] == 200


async def test_a_stuck_heartbeat_loop_fails_liveness(served, clock) -> None:
    state, _, base = served
    state.mark_published()
    state.mark_serving()
    clock.now += 7
    state.tick()
    assert (await fetch(f"{base}/healthz"))[::2] == (503, b"heartbeat loop quiet for 7 s\n")


async def test_metrics_are_served_as_prometheus_text(served) -> None:
    _, metrics, base = served
    metrics.count_requests("alice", "ok", 7)
    status, content_type, body = await fetch(f"{base}/metrics")
    assert status == 200 and content_type.startswith("text/plain; version=0.0.4")
    assert b'lmq_requests_total{model="m",outcome="ok",tenant="alice"} 7.0' in body
    status, _, head_body = await fetch(f"{base}/metrics", method="HEAD")
    assert status == 200 and head_body == b""


async def test_unknown_paths_and_methods_are_refused(served) -> None:
    _, _, base = served
    assert (await fetch(f"{base}/nope"))[0] == 404
    assert (await fetch(f"{base}/metrics", method="POST"))[0] == 405


async def test_garbage_is_refused_and_the_server_keeps_serving(served) -> None:
    _, _, base = served
    port = int(base.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"\x00\x01 not http at all\r\n\r\n")
    await writer.drain()
    answer = await reader.read()
    assert b"400" in answer  # the standard library's "Bad request" page
    writer.close()
    await writer.wait_closed()
    assert (await fetch(f"{base}/metrics"))[0] == 200


async def test_a_blocked_event_loop_fails_the_probes_but_can_be_scraped(served) -> None:
    """Probes are judged on the worker's loop: while it is blocked, they fail with 503."""
    state, _, base = served
    state.mark_published()
    state.mark_serving()
    blocked = threading.Event()
    outcome: list[tuple[int, str, bytes]] = []

    def probe() -> None:
        blocked.wait()
        outcome.append(get(f"{base}/healthz", timeout_s=5))
        outcome.append(get(f"{base}/metrics", timeout_s=5))

    prober = threading.Thread(target=probe)
    prober.start()
    blocked.set()
    time.sleep(1.5)  # what a forward pass run on the loop thread would do
    await asyncio.to_thread(prober.join)
    assert outcome[0][::2] == (503, b"event loop did not answer within 0.3 s\n")
    assert outcome[1][0] == 200
    assert (await fetch(f"{base}/healthz"))[0] == 200


def test_probes_listen_on_loopback_unless_told_otherwise() -> None:
    from lmqueue.shared.settings import WorkerSettings

    assert HealthServer.__init__.__defaults__[0] == "127.0.0.1"
    settings = WorkerSettings.from_env({"LMQ_MODEL": "m", "LMQ_METRICS_HOST": "0.0.0.0"})
    assert settings.metrics_host == "0.0.0.0"
    assert WorkerSettings(model="m").metrics_host == "127.0.0.1"
