"""`InflightTable`: the client's requests between submission and their one outcome.

Each request id maps to one `Pending`, settled exactly once (by a reply, the deadline, or
withdrawal), however many replies arrive for it. Identical in-flight requests share one
`Pending` through its dedup key; each caller awaits a future of its own, so a caller that
cancels only withdraws its own interest (what ``asyncio.shield`` would give, without its
second future, two closures and extra loop pass per call), and the request is dropped once
nobody waits for it.

Deadlines share one loop timer: requests join a queue in deadline order (they do, having one
timeout each, unless a wait for an in-flight slot shortened one: that one gets a timer of its
own), and the timer fires at the earliest deadline. A timer per request cost several percent
of a call's CPU (creating it, cancelling it, and the event loop's rebuilding of a heap full of
cancelled ones; BENCHMARKS.md, transport).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field

import numpy as np

from lmqueue.shared.errors import Cancelled, DeadlineExceeded, LMQueueError
from lmqueue.shared.prompt_key import PromptKey
from lmqueue.shared.wire import Reply, Request

from .tensors import widened

__all__ = ["Pending", "InflightTable"]

logger = logging.getLogger(__name__)

#: The loop may run a timer a hair before its time; a deadline this close counts as come.
_EARLY_S = 0.001


@dataclass(eq=False, slots=True)
class Pending:
    """One in-flight request and the futures of the callers waiting for it."""

    request: Request
    #: The request's prompt key (adapter and tokens), built once by the client.
    prompt: PromptKey
    dedup_key: Hashable
    waiters: list[asyncio.Future[np.ndarray]] = field(default_factory=list)
    #: Its own timer, when its deadline came out of order (see the module docstring).
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    #: Loop time of its deadline (0: none), and the timeout that set it.
    deadline: float = 0.0
    timeout_s: float = 0.0
    #: Sent again for an inline reply after its claim-check missed: skip the cache lookup.
    inline_retry: bool = False
    #: It has its outcome (its waiters have theirs).
    settled: bool = False

    @property
    def request_id(self) -> str:
        """The request's id (unique per client)."""
        return self.request.request_id


class InflightTable:
    """Pending requests by id and by dedup key, with deadlines on the running loop."""

    def __init__(
        self,
        client_id: str,
        on_settled: Callable[[], None] | None = None,
        keep_float16: bool = False,
    ) -> None:
        self.client_id = client_id
        #: Whether float16 results are handed out as they came (``half_results``), not widened.
        self.keep_float16 = keep_float16
        #: Called once for every request that settles, however it settles.
        self.on_settled = on_settled
        self._by_id: dict[str, Pending] = {}
        self._by_key: dict[Hashable, Pending] = {}
        self._sequence = itertools.count()
        self._deadlines: deque[Pending] = deque()  # in deadline order; settled ones linger
        self._timer: asyncio.TimerHandle | None = None
        self.duplicate_replies = 0
        self.resolved = 0

    def next_request_id(self) -> str:
        """A request id unique within this client (and so globally, with the client id)."""
        return f"{self.client_id}:{next(self._sequence)}"

    def find(self, dedup_key: Hashable) -> Pending | None:
        """The in-flight request with this dedup key, if any."""
        return self._by_key.get(dedup_key)

    def get(self, request_id: str) -> Pending | None:
        """The in-flight request with this id, if it is still waiting for its outcome."""
        return self._by_id.get(request_id)

    def add(
        self, request: Request, prompt: PromptKey, dedup_key: Hashable, timeout_s: float
    ) -> Pending:
        """Register a new request for `prompt`; it fails with `DeadlineExceeded` after
        `timeout_s` (0: never)."""
        pending = Pending(request, prompt, dedup_key)
        self._by_id[request.request_id] = pending
        self._by_key[dedup_key] = pending
        if timeout_s:
            self._schedule(pending, timeout_s)
        return pending

    def _schedule(self, pending: Pending, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        pending.timeout_s = timeout_s
        pending.deadline = deadline = loop.time() + timeout_s
        queue = self._deadlines
        if queue and deadline < queue[-1].deadline:
            pending.timer = loop.call_at(deadline, self._expire, pending)
            return
        if len(queue) > 2 * len(self._by_id) + 64:  # drop settled ones, in amortized O(1)
            self._deadlines = queue = deque(p for p in queue if not p.settled)
        queue.append(pending)
        if self._timer is None:
            self._timer = loop.call_at(queue[0].deadline, self._expire_due)

    def _expire_due(self) -> None:
        """Expire every queued request whose deadline has come; wait for the next one."""
        self._timer = None
        queue = self._deadlines
        now = asyncio.get_running_loop().time() + _EARLY_S
        while queue and (queue[0].settled or queue[0].deadline <= now):
            pending = queue.popleft()
            if not pending.settled:
                self._expire(pending)
        if queue:
            self._timer = asyncio.get_running_loop().call_at(queue[0].deadline, self._expire_due)

    @staticmethod
    def wait(pending: Pending) -> asyncio.Future[np.ndarray]:
        """A new future of one caller, settled with the request."""
        waiter: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        pending.waiters.append(waiter)
        return waiter

    def leave(self, pending: Pending, waiter: asyncio.Future[np.ndarray]) -> None:
        """A caller stopped waiting (it was cancelled); drop the request once nobody waits."""
        if waiter in pending.waiters:
            pending.waiters.remove(waiter)
        self.withdraw(pending)

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Pending]:
        return iter(list(self._by_id.values()))

    def resolve(self, reply: Reply) -> bool:
        """Settle the request `reply` answers; False if it is unknown or already settled."""
        pending = self._by_id.get(reply.request_id)
        if pending is None:
            self.duplicate_replies += 1
            return False
        if reply.error is not None:
            self._settle(pending, error=reply.error)
        else:  # the reply thread widened it already; other paths' 16-bit vectors are widened here
            self._settle(pending, value=widened(reply, self.keep_float16).vector())
        return True

    def fail(self, request_id: str, error: LMQueueError) -> None:
        """Settle one request with `error` (e.g. its reply did not decode)."""
        pending = self._by_id.get(request_id)
        if pending is not None:
            self._settle(pending, error=error)

    def fail_all(self, error_factory: type[LMQueueError], message: str) -> None:
        """Settle every request with a fresh error each (client closing)."""
        for pending in list(self._by_id.values()):
            self._settle(pending, error=error_factory(message))
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._deadlines.clear()

    def withdraw(self, pending: Pending) -> None:
        """Drop a request nobody waits for any more; a late reply is then ignored."""
        if not pending.waiters and self._by_id.get(pending.request_id) is pending:
            self._settle(pending, error=Cancelled("withdrawn by its caller"))

    def _expire(self, pending: Pending) -> None:
        timeout_s = pending.timeout_s
        error = DeadlineExceeded(
            f"no result within {timeout_s:g} s", request_id=pending.request_id, timeout_s=timeout_s
        )
        self._settle(pending, error=error)

    def _settle(
        self, pending: Pending, value: np.ndarray | None = None, error: BaseException | None = None
    ) -> None:
        if pending.settled:
            return
        pending.settled = True
        self._by_id.pop(pending.request_id, None)
        if self._by_key.get(pending.dedup_key) is pending:
            del self._by_key[pending.dedup_key]
        if pending.timer is not None:
            pending.timer.cancel()
        self.resolved += 1
        handed = False
        for waiter in pending.waiters:
            if waiter.done():  # its caller was cancelled
                continue
            if error is not None:
                waiter.set_exception(error)
                continue
            assert value is not None, "a settled request has a value or an error"
            # a writable value is the first waiter's to take over; the others get copies
            waiter.set_result(value.copy() if handed and value.flags.writeable else value)
            handed = True
        # A settled request may linger in the deadline queue for a while; its results must not
        # (2,000 in flight kept ~2,000 finished vectors alive, fresh pages for every reply).
        pending.waiters.clear()
        if self.on_settled is not None:
            self.on_settled()
