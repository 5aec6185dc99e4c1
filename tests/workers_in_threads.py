"""`ThreadedWorker`: a real `Worker` serving on its own event loop in a thread.

Client tests need a worker that keeps serving while the test's own loop is blocked (sync
calls) or busy; a thread gives that without the start-up cost of a process. Process-level
behaviour (crashes, signals) is tested with real worker processes elsewhere.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from lmqueue.shared.connections import connect_async_redis
from lmqueue.shared.lm.interface import AsyncLM
from lmqueue.shared.settings import RedisSettings, WorkerSettings
from lmqueue.workers.worker import Worker


class ThreadedWorker:
    """Start with `start()`, stop with `stop()`; `worker` is the live `Worker`."""

    def __init__(
        self,
        backend: AsyncLM,
        redis_url: str,
        model: str = "mock",
        masses: Any = None,
        **settings: Any,
    ):
        self.backend = backend
        self.masses = masses
        redis = settings.pop("redis", None) or RedisSettings(url=redis_url)
        settings.setdefault("name", "t-worker")
        self.settings = WorkerSettings(model=model, backend="mock", redis=redis, **settings)
        self.worker: Worker | None = None
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ready = threading.Event()
        self.error: BaseException | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # surfaced by stop()
            self.error = exc
            self._ready.set()
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        redis = await connect_async_redis(self.settings.redis.url)
        self._stop = asyncio.Event()
        self.worker = Worker(self.settings, self.backend, redis, masses=self.masses)
        await self.worker.publish()
        self._ready.set()
        try:
            await self.worker.serve(self._stop)
        finally:
            await redis.aclose()

    def start(self) -> ThreadedWorker:
        """Start serving; returns once the model is published."""
        self._thread.start()
        if not self._ready.wait(30):
            raise TimeoutError("worker did not publish its model")
        if self.error is not None:
            raise self.error
        return self

    def stop(self) -> None:
        """Stop serving and join the thread."""
        if self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        if self.error is not None:
            raise self.error

    @property
    def answered(self) -> int:
        """Entries answered so far."""
        return self.worker.answered if self.worker else 0
