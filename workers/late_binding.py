"""Late binding: a worker picks its next batch only when the backend is done with the last.

A worker's `FairShare` scheduler picks the next batch's members (reading its streams just
before) only when the backend is about to be done with the previous batch
(`BackendOccupancy`: a fifth of a forward before its expected end). Picked earlier (a whole
forward ahead, as a plain prefetch does), a batch's membership is fixed before requests
arriving meanwhile could join it: a light tenant's request arriving during one forward would
wait for that forward, the one already picked, then its own. Picked only once the backend is
idle, the backend would idle while the batch is read, picked and decoded. What comes after a
forward (encoding, writing replies, acknowledging) overlaps the next batch's forward.

A batch runs as one part per tenant, concurrently, and the backend batches the calls it has
when it starts a forward; a part that looked up the cache a little later than the others
would miss its batch's forward and wait for the next. So the parts of a batch call the
backend together (`BatchForward`): each waits until every part is ready to compute.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from lmqueue.shared import stage_trace

__all__ = ["BackendOccupancy", "BatchForward", "ForwardPart", "ForwardStart"]


#: How far ahead of a forward's expected end the next batch is picked, as a fraction of the
#: forward: enough for reading, picking and decoding to reach the backend before it is idle.
PICK_LEAD = 0.2
#: Weight of the newest forward in the running estimate of a forward's duration.
_NEWEST = 0.2


class BackendOccupancy:
    """Batches picked and not yet through the backend, and when the backend will be done.

    A backend runs up to `forwards` batches at once (`parallel_forwards`; one by default).
    While fewer are held, the next batch may be picked at once. With all of them held, it may
    be picked when the oldest is expected to end within `PICK_LEAD` of a forward (the running
    estimate of a forward's duration, from the batches released so far): its calls then wait
    at the backend for that forward, as a prefetched batch's would, but their membership was
    decided only that much earlier. Beyond that, picking waits for a release. It also keeps
    what anticipation's bound needs: since when the backend holds no batch (`idle_since`) and
    how long the backend itself takes for one (`compute_s`, from `BatchForward`).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, forwards: int = 1) -> None:
        if forwards < 1:
            raise ValueError(f"forwards={forwards}: at least one")
        self.clock = clock
        self.forwards = forwards
        self.forward_s = 0.0  # running estimate; 0 until a batch was released
        #: Running estimate of the backend's own part of a forward (`computed`), without the
        #: reading, decoding and waiting of a batch in the slot: what idling costs.
        self.compute_s = 0.0
        self._held = 0
        #: When the backend began each batch it runs (or was given it), by hold, oldest first ...
        self._running: dict[int, float] = {}
        #: ... and the held batches beyond `forwards`, waiting for a place, in order.
        self._waiting: list[int] = []
        #: What to call when a waiting batch gets its place (`hold`'s `placed`).
        self._on_place: dict[int, Callable[[], None]] = {}
        self._next_hold = 0
        self._idle_since = clock()
        self._changed = asyncio.Event()

    @property
    def busy(self) -> bool:
        """Whether a picked batch is still waiting for or in the backend."""
        return self._held > 0

    @property
    def idle_since(self) -> float | None:
        """When the backend was last left with no batch (None: it holds one now)."""
        return None if self._held else self._idle_since

    def pick_in_s(self) -> float | None:
        """Seconds until the next batch may be picked: 0 now, None until a release.

        Before any forward was measured, one batch may wait at the backend behind those it
        runs (a batch of cache hits, say, need not wait for a first long forward at all).
        """
        if self._held < self.forwards:
            return 0.0
        if not self.forward_s:  # nothing measured yet: one batch ahead, as a prefetch
            return 0.0 if self._held == self.forwards else None
        if self._held > self.forwards:
            return None
        oldest = next(iter(self._running.values()))
        return max(oldest + (1 - PICK_LEAD) * self.forward_s - self.clock(), 0.0)

    def hold(self, placed: Callable[[], None] | None = None) -> Callable[[], None]:
        """Hold the slot for one batch; returns its release, which only its first call does.

        `placed` is called when the batch gets a place at the backend: at once if one is free,
        else when a batch ahead of it is released (a batch picked a little before the backend
        is done waits there meanwhile).
        """
        hold = self._next_hold
        self._next_hold += 1
        self._held += 1
        if len(self._running) < self.forwards:
            self._running[hold] = self.clock()
            if placed is not None:
                placed()
        else:
            self._waiting.append(hold)
            if placed is not None:
                self._on_place[hold] = placed
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            now = self.clock()
            began = self._running.pop(hold, None)
            if began is None:  # released before it had a place (a batch of cache hits)
                self._waiting.remove(hold)
                self._on_place.pop(hold, None)
            else:
                took_s = now - began
                self.forward_s = _running(self.forward_s, took_s)
            self._held -= 1
            if not self._held:
                self._idle_since = now
            if self._waiting and len(self._running) < self.forwards:
                placed_hold = self._waiting.pop(0)
                self._running[placed_hold] = now  # it has the backend from now
                if (on_place := self._on_place.pop(placed_hold, None)) is not None:
                    on_place()
            self._changed.set()
            self._changed = asyncio.Event()

        return release

    def computed(self, took_s: float) -> None:
        """The backend computed a batch's forward in `took_s` (`BatchForward`)."""
        self.compute_s = _running(self.compute_s, took_s)

    async def wait_to_pick(self, timeout_s: float) -> bool:
        """Wait until the next batch may be picked, at most `timeout_s`; whether it may."""
        deadline = self.clock() + timeout_s
        while (wait_s := self.pick_in_s()) != 0.0:
            left_s = deadline - self.clock()
            if left_s <= 0:
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(wait_s or left_s, left_s))
        return True


def _running(estimate: float, took_s: float) -> float:
    """A running estimate of a duration after one more measurement (0: none yet)."""
    return took_s if not estimate else _NEWEST * took_s + (1 - _NEWEST) * estimate


class ForwardStart:
    """When a batch's forward starts: once its parts are released to call the backend and the
    backend has a place for it (`BackendOccupancy.hold`'s `placed`), whichever comes later.

    A batch picked a little before the backend is done (late binding's lead) calls it while
    the forward ahead still runs: its calls wait at the backend until that one ends. Counted
    from its release, its forward would include that wait (the anticipation bound,
    `BackendOccupancy.compute_s`, would grow with it), and the stage trace's
    ``forward_start`` would show the backend idle while it ran the batch ahead (a real model
    under a flood: 0.3-0.5 s of "idle" between forwards that ran back to back).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, placed: bool = False) -> None:
        self._clock = clock
        self._missing = 1 if placed else 2
        #: When it started (None: not yet).
        self.at: float | None = None

    def placed(self) -> None:
        """The backend has a place for the batch (called once)."""
        self._one()

    def released(self) -> None:
        """The batch's parts are released to call the backend (called once)."""
        self._one()

    def _one(self) -> None:
        self._missing -= 1
        if self._missing == 0:
            self.at = self._clock()
            stage_trace.mark("forward_start")


class BatchForward:
    """One batch's parts on their way to the backend: they call it together, and `computed`
    is called once the backend is done with all of them (`timed` with the seconds from the
    forward's start, `ForwardStart`, to then). `started` is called once, when every part has
    arrived: the parts are released to call the backend (or, all cache hits or refusals, need
    none), so work deferred until then no longer delays them. Without `start`, the backend
    is taken to have a place for the batch at once."""

    def __init__(
        self,
        parts: int,
        computed: Callable[[], None] | None = None,
        timed: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        started: Callable[[], None] | None = None,
        start: ForwardStart | None = None,
    ) -> None:
        self._clock = clock
        self._parts = parts
        self._not_ready = parts
        self._not_computed = parts
        self._all_ready = asyncio.Event()
        self._computed = computed
        self._timed = timed
        self._started = started
        self._start = start if start is not None else ForwardStart(clock, placed=True)
        self._calls = False  # whether any part calls the backend (cache hits do not)
        self._after: list[Callable[[], None]] = []  # called once every part is computed
        if not parts:
            self._release()

    def part(self) -> ForwardPart:
        """The handle of one part (make exactly as many as `parts`)."""
        return ForwardPart(self)

    def after(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the backend is done with every part (now, if it is)."""
        if self._not_computed <= 0:
            callback()
        else:
            self._after.append(callback)

    def _arrive(self) -> bool:
        """One more part is ready; whether it was the last (the batch is released now)."""
        self._not_ready -= 1
        if self._not_ready <= 0 and not self._all_ready.is_set():
            self._release()
            return True
        return False

    def _release(self) -> None:
        # The waiting parts are woken before whatever `started` wakes, so they call the
        # backend first; the last part to arrive follows them (`ForwardPart.ready`).
        self._all_ready.set()
        self._start.released()
        if self._started is not None:
            self._started()

    def _done(self) -> None:
        self._not_computed -= 1
        if self._not_computed:
            return
        stage_trace.mark("forward_end")
        if self._computed is not None:
            self._computed()
        after, self._after = self._after, []
        for callback in after:
            callback()
        began = self._start.at
        if self._timed is not None and self._calls and began is not None:
            self._timed(self._clock() - began)


class ForwardPart:
    """One part of a `BatchForward`; `computed` must be called on every path (it is
    idempotent), or the other parts wait for this one forever."""

    def __init__(self, batch: BatchForward) -> None:
        self._batch = batch
        self._ready = False
        self._computed = False

    async def ready(self) -> None:
        """This part is about to call the backend: wait until every part is.

        The parts then call it in the order they arrived: the last one lets those woken by
        its arrival go first, rather than running on to the backend ahead of them (the worker
        orders a batch's parts so that an awaited tenant's rows come first, `Worker._handle`).
        """
        self._batch._calls = True
        last = False
        if not self._ready:
            self._ready = True
            last = self._batch._arrive()
        await self._batch._all_ready.wait()
        if last and self._batch._parts > 1:
            await asyncio.sleep(0)

    def after_batch(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the backend is done with every part of the batch (now, if
        it is): a part answered first (a split batch's first forward) is done before the rest."""
        self._batch.after(callback)

    def computed(self) -> None:
        """The backend is done with this part (or it needs none, or it failed)."""
        if not self._ready:
            self._ready = True
            self._batch._arrive()
        if not self._computed:
            self._computed = True
            self._batch._done()
