"""`SyncPortal`: blocking calls into a `QueueLM` that lives on a private event-loop thread.

A synchronous call cannot wait on the event loop it is called from (the loop would have to
run to deliver the reply), so sync calls go to a second client on a loop of their own, in a
daemon thread. The portal is started on the first sync call and closed with its client.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from shared.settings import ClientSettings

__all__ = ["SyncPortal"]


class SyncPortal:
    """A private loop thread hosting one connected `QueueLM`."""

    def __init__(self, model: str, settings: ClientSettings) -> None:
        from .client import QueueLM  # the client module imports this one

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lmq-sync", daemon=True)
        self._thread.start()
        try:
            self.client = self._submit(QueueLM.connect(model, settings=settings))
        except BaseException:
            self._stop_loop()
            raise

    def call(self, method: str, *args: Any) -> Any:
        """Run ``client.<method>(*args)`` on the portal's loop and wait for its result."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("a sync call from the portal's own loop would deadlock")
        return self._submit(getattr(self.client, method)(*args))

    def _submit(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def close(self) -> None:
        """Close the client and stop the thread."""
        try:
            self._submit(self.client.close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
