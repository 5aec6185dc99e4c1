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
    async with HealthServer(state, metrics.registry, host="127.0.0.1") as server:
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


async def test_garbage_gets_no_answer_and_the_server_keeps_serving(served) -> None:
    _, _, base = served
    port = int(base.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"\x00\x01 not http at all\r\n\r\n")
    await writer.drain()
    assert await reader.read() == b""
    writer.close()
    assert (await fetch(f"{base}/metrics"))[0] == 200


async def test_a_blocked_event_loop_answers_no_probe(served) -> None:
    """The server shares the worker's loop: while the loop is blocked, probes time out."""
    state, _, base = served
    state.mark_published()
    state.mark_serving()
    blocked = threading.Event()
    outcome: list[object] = []

    def probe() -> None:
        blocked.wait()
        try:
            outcome.append(get(f"{base}/healthz", timeout_s=0.5))
        except (TimeoutError, urllib.error.URLError) as exc:
            outcome.append(exc)

    prober = threading.Thread(target=probe)
    prober.start()
    blocked.set()
    time.sleep(1.5)  # what a forward pass run on the loop thread would do
    await asyncio.to_thread(prober.join)
    assert len(outcome) == 1 and isinstance(outcome[0], TimeoutError | urllib.error.URLError)
    assert (await fetch(f"{base}/healthz"))[0] == 200
