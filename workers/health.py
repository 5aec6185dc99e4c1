"""`HealthServer`: ``/metrics``, ``/healthz`` and ``/readyz`` over HTTP, on the worker's own loop.

A few dozen lines of HTTP/1.1 on `asyncio.start_server` instead of a framework: three GET
paths, one response per connection. The server runs on the event loop that reads requests and
writes heartbeats, on purpose: a loop blocked by a forward pass or a deadlock cannot answer,
so the liveness probe fails exactly when the worker is stuck.

- ``/healthz`` (liveness): 200 once the worker serves, while its read loop has turned within
  `loop_stale_s` and its heartbeat loop has run within `heartbeat_stale_s`; 503 before that
  (model loading: use a startup probe) and when either went quiet. A Redis outage does not
  fail liveness (restarting the worker would not bring Redis back); it fails readiness.
- ``/readyz`` (readiness): 200 while the model is loaded and published and the last heartbeat
  reached Redis within `heartbeat_stale_s`; 503 while loading, when Redis is unreachable, while
  a Redis Cluster client is being rebuilt (it lost every node: `shared.cluster_client`) and
  from the moment the worker is told to stop.
- ``/metrics``: the Prometheus text exposition of the worker's registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from types import TracebackType

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

__all__ = ["HealthState", "HealthServer"]

logger = logging.getLogger(__name__)

_MAX_REQUEST_BYTES = 8192
_READ_TIMEOUT_S = 5.0
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


class HealthState:
    """What the probes judge: the worker's phase and when its loops last turned.

    Args:
        loop_stale_s: liveness fails when the read loop has not turned for this long.
        heartbeat_stale_s: liveness fails when the heartbeat loop has not run for this long,
            readiness when no heartbeat reached Redis for this long.
        clock: a monotonic clock (tests pass their own).
    """

    def __init__(
        self,
        loop_stale_s: float = 60.0,
        heartbeat_stale_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.loop_stale_s = loop_stale_s
        self.heartbeat_stale_s = heartbeat_stale_s
        self.clock = clock
        self.serving = False
        self.published = False
        self.stopping = False
        self._loop_tick = 0.0
        self._heartbeat_run = 0.0
        self._heartbeat_ok = 0.0
        self._cluster: Callable[[], tuple[int, bool]] = lambda: (0, False)

    def mark_serving(self) -> None:
        """The read loop is about to start: liveness is judged from now on."""
        now = self.clock()
        self.serving = True
        self._loop_tick = self._heartbeat_run = max(self._loop_tick, now)

    def mark_published(self) -> None:
        """The model is loaded and published, and a heartbeat was written."""
        self.published = True
        self._heartbeat_ok = self._heartbeat_run = self.clock()

    def mark_stopping(self) -> None:
        """The worker was told to stop: it takes no new work, so it is not ready."""
        self.stopping = True

    def watch_cluster(self, state: Callable[[], tuple[int, bool]]) -> None:
        """Judge readiness also by `state` (rebuilds so far, one under way) of the worker's
        Redis Cluster clients: a worker rebuilding its cluster connection takes no work."""
        self._cluster = state

    def tick(self) -> None:
        """The read loop turned."""
        self._loop_tick = self.clock()

    def heartbeat(self, reached_redis: bool) -> None:
        """The heartbeat loop ran; `reached_redis` tells whether the heartbeat was written."""
        now = self.clock()
        self._heartbeat_run = now
        if reached_redis:
            self._heartbeat_ok = now

    def liveness(self) -> tuple[bool, str]:
        """Whether the worker is alive, and why not."""
        if not self.serving:
            return False, "starting"
        now = self.clock()
        if now - self._loop_tick > self.loop_stale_s:
            return False, f"read loop quiet for {now - self._loop_tick:.0f} s"
        if now - self._heartbeat_run > self.heartbeat_stale_s:
            return False, f"heartbeat loop quiet for {now - self._heartbeat_run:.0f} s"
        return True, "alive"

    def readiness(self) -> tuple[bool, str]:
        """Whether the worker takes work, and why not."""
        if self.stopping:
            return False, "stopping"
        if not self.published:
            return False, "loading"
        rebuilds, rebuilding = self._cluster()
        if rebuilding:
            return False, f"rebuilding the Redis Cluster connection (rebuild {rebuilds})"
        age_s = self.clock() - self._heartbeat_ok
        if age_s > self.heartbeat_stale_s:
            return False, f"no heartbeat reached Redis for {age_s:.0f} s"
        return True, "ready"


class HealthServer:
    """Serves the probes and the metrics of one worker on `host`:`port` (0: any free port)."""

    def __init__(
        self, state: HealthState, registry: CollectorRegistry, host: str = "0.0.0.0", port: int = 0
    ) -> None:
        self.state = state
        self.registry = registry
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        """Start listening; returns the port."""
        self._server = await asyncio.start_server(
            self._serve, self.host, self.port, limit=_MAX_REQUEST_BYTES
        )
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("metrics and probes on http://%s:%d/metrics", self.host, self.port)
        return self.port

    async def close(self) -> None:
        """Stop listening and wait for open connections to finish."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> HealthServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT_S)
            method, path = _request_line(head)
            status, content_type, body = self._respond(method, path)
            writer.write(_response(status, content_type, body, with_body=method != "HEAD"))
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError,
                ConnectionError, ValueError):  # fmt: skip
            pass  # a broken or hostile request gets no answer
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def _respond(self, method: str, path: str) -> tuple[int, str, bytes]:
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"only GET and HEAD\n"
        path = path.partition("?")[0]
        if path == "/metrics":
            # the classic text format: every lmq name is a legacy one; every Prometheus reads it
            return 200, CONTENT_TYPE_PLAIN_0_0_4, generate_latest(self.registry)
        if path in ("/healthz", "/readyz"):
            ok, why = self.state.liveness() if path == "/healthz" else self.state.readiness()
            return (200 if ok else 503), "text/plain", f"{why}\n".encode()
        return 404, "text/plain", b"try /metrics, /healthz or /readyz\n"


def _request_line(head: bytes) -> tuple[str, str]:
    """Method and path of an HTTP request head; ValueError if it is not one."""
    method, path, version = head.split(b"\r\n", 1)[0].decode("ascii").split(" ")
    if not version.startswith("HTTP/"):
        raise ValueError(f"not an HTTP request: {version!r}")
    return method, path


def _response(status: int, content_type: str, body: bytes, with_body: bool = True) -> bytes:
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("ascii") + (body if with_body else b"")
