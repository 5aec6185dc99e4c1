"""Blocking calls into an async client: `SyncPortal` and the `SyncFacade` built on it.

A synchronous call cannot wait on the event loop it is called from (the loop would have to
run to deliver the reply), so sync calls go to a second client on a loop of its own, in a
daemon thread: the portal. It is started on the first sync call and closed with its client.
From another thread while the client's own loop runs, a sync call goes to that loop instead.

Neither class knows the client's type: the portal is handed a coroutine that connects one,
and the facade is mixed into the client class (`QueueLM`), so nothing here imports it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from lmqueue.shared.errors import Cancelled
from lmqueue.shared.settings import ClientSettings

if TYPE_CHECKING:
    import torch

__all__ = ["SyncPortal", "SyncFacade"]


class SyncPortal:
    """A private loop thread hosting one client, connected by `connect` on that loop."""

    def __init__(self, connect: Callable[[], Awaitable[Any]]) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lmq-sync", daemon=True)
        self._thread.start()
        try:
            self.client = self._submit(connect())
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


class SyncFacade:
    """The ``*_sync`` methods and `connect_sync` of an async client class.

    The class mixing it in provides ``connect(model, settings=...)``, ``close()``, the async
    methods named here, and the attributes ``model``, ``settings`` and ``closed``.
    """

    model: str
    settings: ClientSettings
    _portal: SyncPortal | None = None
    _owner_portal: SyncPortal | None = None
    _home_loop: asyncio.AbstractEventLoop | None = None

    @property
    def closed(self) -> bool:  # pragma: no cover - provided by the client class
        raise NotImplementedError

    def next_token_logprobs_sync(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """Blocking `next_token_logprobs`; callable from any thread, inside a running loop too."""
        return self._call_sync("next_token_logprobs", list(token_ids), lora_name)

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Sequence[Sequence[int]], lora_name: str | None = None
    ) -> torch.Tensor:
        """Blocking `batch_next_token_logprobs`: the rows are computed concurrently."""
        prompts = [list(ids) for ids in token_ids_list]
        return self._call_sync("batch_next_token_logprobs", prompts, lora_name)

    def _call_sync(self, method: str, *args: Any) -> Any:
        """Run an async method to completion from synchronous code.

        From another thread while this client's loop runs, the call goes to that loop; from
        the loop's own thread (or with no loop running) it goes to a private `SyncPortal`.
        """
        if self.closed:
            raise Cancelled("the client is closed")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        home = self._home_loop
        if home is not None and home.is_running() and running is not home:
            return asyncio.run_coroutine_threadsafe(getattr(self, method)(*args), home).result()
        if self._portal is None:
            connect = type(self).connect  # type: ignore[attr-defined]
            self._portal = SyncPortal(lambda: connect(self.model, settings=self.settings))
        return self._portal.call(method, *args)

    @classmethod
    def connect_sync(cls, model: str, redis_url: str | None = None, **kwargs: Any) -> Any:
        """For synchronous programs: a client living on a private loop thread.

        Use its ``*_sync`` methods, and `close_sync` when done.
        """
        settings = ClientSettings.resolve(kwargs.pop("settings", None), redis_url, **kwargs)
        connect = cls.connect  # type: ignore[attr-defined]
        portal = SyncPortal(lambda: connect(model, settings=settings))
        portal.client._owner_portal = portal
        return portal.client

    def close_sync(self) -> None:
        """Close a client made by `connect_sync` (or any client, from another thread)."""
        if self._owner_portal is not None:
            self._owner_portal.close()
            return
        home = self._home_loop
        if home is None or not home.is_running():
            raise RuntimeError("close_sync needs the client's loop running in another thread")
        asyncio.run_coroutine_threadsafe(self.close(), home).result()  # type: ignore[attr-defined]

    async def _close_portal(self) -> None:
        """Close the private portal of sync calls, if one was started."""
        if self._portal is not None:
            await asyncio.to_thread(self._portal.close)
