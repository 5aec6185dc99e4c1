"""`HealthServer`: ``/metrics``, ``/healthz`` and ``/readyz`` over HTTP, from the standard library.

HTTP is the standard library's (`http.server.ThreadingHTTPServer`, a thread of its own), not
hand-written: prometheus_client's own server serves only metrics, and aiohttp is no
dependency of lmqueue. The probes are still judged on the worker's event loop, on purpose:
each probe request asks the loop for the answer, and a loop that does not answer within
`loop_answer_s` (blocked by a forward pass, deadlocked) fails the probe with 503, so
liveness fails exactly when the worker is stuck. ``/metrics`` is rendered in the server's
thread (prometheus_client is thread-safe), so a busy loop can still be scraped.

- ``/healthz`` (liveness): 200 once the worker serves, while its read loop has turned within
  `loop_stale_s` and its heartbeat loop has run within `heartbeat_stale_s`; 503 before that
  (model loading: use a startup probe) and when either went quiet. A Redis outage does not
  fail liveness (restarting the worker would not bring Redis back); it fails readiness.
- ``/readyz`` (readiness): 200 while the model is loaded and published and the last heartbeat
  reached Redis within `heartbeat_stale_s`; 503 while loading, when Redis is unreachable, while
  a Redis Cluster client is being rebuilt (it lost every node: `shared.cluster_client`) and
  from the moment the worker is told to stop.
- ``/metrics``: the Prometheus text exposition of the worker's registry.

The address defaults to loopback (``LMQ_METRICS_HOST``, ``--metrics-host``): metrics name
tenants and models and show their traffic, which a shared host's other users need not see.
Containers set ``0.0.0.0`` (the kubelet probes the pod's address; docs/OPERATIONS.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

__all__ = ["HealthState", "HealthServer", "DEFAULT_METRICS_HOST"]

logger = logging.getLogger(__name__)

#: Where probes and metrics listen unless told otherwise.
DEFAULT_METRICS_HOST = "127.0.0.1"
_READ_TIMEOUT_S = 5.0


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
    """Serves the probes and the metrics of one worker on `host`:`port` (0: any free port).

    Args:
        loop_answer_s: a probe fails with 503 when the event loop that started the server has
            not answered it within this long.
    """

    def __init__(
        self,
        state: HealthState,
        registry: CollectorRegistry,
        host: str = DEFAULT_METRICS_HOST,
        port: int = 0,
        loop_answer_s: float = 2.0,
    ) -> None:
        self.state = state
        self.registry = registry
        self.host = host
        self.port = port
        self.loop_answer_s = loop_answer_s
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> int:
        """Start listening; returns the port."""
        self._loop = asyncio.get_running_loop()
        server = ThreadingHTTPServer((self.host, self.port), _handler_for(self))
        server.daemon_threads = True
        self._server = server
        self.port = server.server_address[1]
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="lmq-health",
            daemon=True,
        )  # fmt: skip
        self._thread.start()
        logger.info("metrics and probes on http://%s:%d/metrics", self.host, self.port)
        return self.port

    async def close(self) -> None:
        """Stop listening and wait for the server's thread to end."""
        server, self._server = self._server, None
        if server is not None:
            await asyncio.to_thread(server.shutdown)
            server.server_close()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

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

    def respond(self, method: str, path: str) -> tuple[int, str, bytes]:
        """Status, content type and body for one request (called in the server's thread)."""
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"only GET and HEAD\n"
        path = path.partition("?")[0]
        if path == "/metrics":
            # the classic text format: every lmq name is a legacy one; every Prometheus reads it
            return 200, CONTENT_TYPE_PLAIN_0_0_4, generate_latest(self.registry)
        if path in ("/healthz", "/readyz"):
            judge = self.state.liveness if path == "/healthz" else self.state.readiness
            ok, why = self._on_loop(judge)
            return (200 if ok else 503), "text/plain", f"{why}\n".encode()
        return 404, "text/plain", b"try /metrics, /healthz or /readyz\n"

    def _on_loop(self, judge: Callable[[], tuple[bool, str]]) -> tuple[bool, str]:
        """`judge()` run on the worker's event loop; failed if the loop does not answer."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return False, "stopped"

        async def ask() -> tuple[bool, str]:
            return judge()

        future = asyncio.run_coroutine_threadsafe(ask(), loop)
        try:
            return future.result(self.loop_answer_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return False, f"event loop did not answer within {self.loop_answer_s:g} s"


def _handler_for(server: HealthServer) -> type[BaseHTTPRequestHandler]:
    """A request handler class answering through `server.respond`."""

    class Handler(BaseHTTPRequestHandler):
        timeout = _READ_TIMEOUT_S  # a client that sends nothing is dropped
        protocol_version = "HTTP/1.0"  # one response per connection

        def _answer(self) -> None:
            status, content_type, body = server.respond(self.command, self.path)
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = _answer

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib's name
            logger.debug("%s " + format, self.address_string(), *args)

    return Handler
