"""Late binding: a worker picks its next batch only when the backend is done with the last.

A worker reads and queues requests ahead of the backend, but its `FairShare` scheduler picks
the next batch's members only once the backend has computed the previous batch's prompts
(`BackendSlot`). Picked earlier (a batch-duration ahead, as a plain prefetch does), a batch's
membership is fixed before requests arriving meanwhile could join it: a light tenant's request
arriving during one forward would wait for that forward, the one already picked, then its
own. What comes after a forward (encoding, writing replies, acknowledging) still overlaps the
next batch's forward.

A batch runs as one part per tenant, concurrently, and the backend batches the calls it has
when it starts a forward; a part that looked up the cache a little later than the others
would miss its batch's forward and wait for the next. So the parts of a batch call the
backend together (`BatchForward`): each waits until every part is ready to compute.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

__all__ = ["BackendSlot", "BatchForward", "ForwardPart"]


class BackendSlot:
    """Counts picked batches not yet through the backend; the next pick waits for none."""

    def __init__(self) -> None:
        self._held = 0
        self._free = asyncio.Event()
        self._free.set()

    @property
    def busy(self) -> bool:
        """Whether a picked batch is still waiting for or in the backend."""
        return self._held > 0

    def hold(self) -> Callable[[], None]:
        """Hold the slot for one batch; returns its release, which only its first call does."""
        self._held += 1
        self._free.clear()
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            self._held -= 1
            if not self._held:
                self._free.set()

        return release

    async def wait_free(self, timeout_s: float) -> bool:
        """Wait until no batch holds the slot, at most `timeout_s`; whether it is free."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._free.wait(), timeout_s)
        return not self.busy


class BatchForward:
    """One batch's parts on their way to the backend: they call it together, and `computed`
    is called once the backend is done with all of them."""

    def __init__(self, parts: int, computed: Callable[[], None] | None = None) -> None:
        self._not_ready = parts
        self._not_computed = parts
        self._all_ready = asyncio.Event()
        self._computed = computed
        if not parts:
            self._all_ready.set()

    def part(self) -> ForwardPart:
        """The handle of one part (make exactly as many as `parts`)."""
        return ForwardPart(self)

    def _arrive(self) -> None:
        self._not_ready -= 1
        if self._not_ready <= 0:
            self._all_ready.set()

    def _done(self) -> None:
        self._not_computed -= 1
        if self._not_computed == 0 and self._computed is not None:
            self._computed()


class ForwardPart:
    """One part of a `BatchForward`; `computed` must be called on every path (it is
    idempotent), or the other parts wait for this one forever."""

    def __init__(self, batch: BatchForward) -> None:
        self._batch = batch
        self._ready = False
        self._computed = False

    async def ready(self) -> None:
        """This part is about to call the backend: wait until every part is."""
        if not self._ready:
            self._ready = True
            self._batch._arrive()
        await self._batch._all_ready.wait()

    def computed(self) -> None:
        """The backend is done with this part (or it needs none, or it failed)."""
        if not self._ready:
            self._ready = True
            self._batch._arrive()
        if not self._computed:
            self._computed = True
            self._batch._done()
