"""`InflightTable`: the client's requests between submission and their one outcome.

Each request id maps to one `Pending`: a future that is resolved exactly once (by a reply, the
deadline, or withdrawal), however many replies arrive for it. Identical in-flight requests
share one `Pending` through its dedup key. A caller that cancels only withdraws its own
interest; the request is dropped once nobody waits for it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field

import numpy as np

from shared.errors import Cancelled, DeadlineExceeded, LMQueueError
from shared.wire import Reply, Request

__all__ = ["Pending", "InflightTable"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Pending:
    """One in-flight request and the future its callers await."""

    request: Request
    dedup_key: Hashable
    future: asyncio.Future[np.ndarray]
    waiters: int = 0
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    @property
    def request_id(self) -> str:
        """The request's id (unique per client)."""
        return self.request.request_id


class InflightTable:
    """Pending requests by id and by dedup key, with deadlines on the running loop."""

    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        self._by_id: dict[str, Pending] = {}
        self._by_key: dict[Hashable, Pending] = {}
        self._sequence = itertools.count()
        self.duplicate_replies = 0
        self.resolved = 0

    def next_request_id(self) -> str:
        """A request id unique within this client (and so globally, with the client id)."""
        return f"{self.client_id}:{next(self._sequence)}"

    def find(self, dedup_key: Hashable) -> Pending | None:
        """The in-flight request with this dedup key, if any."""
        return self._by_key.get(dedup_key)

    def add(self, request: Request, dedup_key: Hashable, timeout_s: float) -> Pending:
        """Register a new request; it fails with `DeadlineExceeded` after `timeout_s` (0: never)."""
        loop = asyncio.get_running_loop()
        pending = Pending(request, dedup_key, loop.create_future())
        self._by_id[request.request_id] = pending
        self._by_key[dedup_key] = pending
        if timeout_s:
            pending.timer = loop.call_later(timeout_s, self._expire, pending, timeout_s)
        return pending

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
        else:
            self._settle(pending, value=reply.vector())
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

    def withdraw(self, pending: Pending) -> None:
        """Drop a request nobody waits for any more; a late reply is then ignored."""
        if pending.waiters == 0 and self._by_id.get(pending.request_id) is pending:
            self._settle(pending, error=Cancelled("withdrawn by its caller"))

    def _expire(self, pending: Pending, timeout_s: float) -> None:
        error = DeadlineExceeded(
            f"no result within {timeout_s:g} s", request_id=pending.request_id, timeout_s=timeout_s
        )
        self._settle(pending, error=error)

    def _settle(
        self, pending: Pending, value: np.ndarray | None = None, error: BaseException | None = None
    ) -> None:
        self._by_id.pop(pending.request_id, None)
        if self._by_key.get(pending.dedup_key) is pending:
            del self._by_key[pending.dedup_key]
        if pending.timer is not None:
            pending.timer.cancel()
        if pending.future.done():
            return
        self.resolved += 1
        if error is not None:
            pending.future.set_exception(error)
            if pending.waiters == 0:
                pending.future.exception()  # nobody will await it; mark it retrieved
        else:
            pending.future.set_result(value)
