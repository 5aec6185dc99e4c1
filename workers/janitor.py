"""`Janitor`: recovers entries that a dead or stuck worker left pending, and prunes leftovers.

A worker that dies mid-batch leaves its entries in the group's pending list. Any live worker's
janitor claims entries idle past `claim_idle_ms` (XAUTOCLAIM), and a worker restarted under the
same name re-reads its own, before new work. Such entries were delivered before, and one of
them may be what killed the worker, so both are handed out one at a time for the worker to
answer alone: a request that kills its worker then spends only its own delivery budget, never
its batch-mates'. An entry delivered more than `max_deliveries` times is moved to the model's
dead-letter stream and its client gets `DeadLettered`.

Pruning removes what crashed workers leave behind for good: their consumers in the group
(once idle for `dead_consumer_idle_ms` with nothing pending) and their live-set members.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator

from lmqueue.shared.errors import DeadLettered, MalformedMessage
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.settings import WorkerSettings

from .outcome import Outcome
from .request_stream import Entry, RequestStream

__all__ = ["Janitor"]

logger = logging.getLogger(__name__)


class Janitor:
    """Reclaims idle pending entries of one request stream for its worker, and prunes."""

    def __init__(self, stream: RequestStream, keys: KeySpace, settings: WorkerSettings) -> None:
        self.stream = stream
        self.keys = keys
        self.model = settings.model
        self.claim_idle_ms = settings.claim_idle_ms
        self.max_deliveries = settings.max_deliveries
        self.dead_consumer_idle_ms = settings.dead_consumer_idle_ms
        self.reclaimed_total = 0
        self.dead_lettered_total = 0
        self.pruned_total = 0
        self._next_prune_s = 0.0

    async def idle_entries(self) -> AsyncGenerator[Entry, None]:
        """Claim entries idle past `claim_idle_ms` from any consumer, one per step.

        One at a time because a claim counts as a delivery: claiming a whole batch up front
        would charge entries that a crash then keeps from ever being tried.
        """
        cursor = "0-0"
        while True:
            cursor, claimed = await self.stream.autoclaim(self.claim_idle_ms, 1, cursor)
            for entry in claimed:
                self.reclaimed_total += 1
                logger.info("reclaimed idle entry %s", entry.entry_id)
                yield entry
            if cursor == "0-0":
                return

    async def own_pending(self) -> AsyncGenerator[Entry, None]:
        """This consumer's entries from a previous run (crash, restart), one per step."""
        after: str | None = "0"
        while after is not None:
            after, entries = await self.stream.read_own_pending(1, after)
            for entry in entries:
                logger.info("re-answering entry %s pending from a previous run", entry.entry_id)
                yield entry

    async def park_if_exhausted(self, entry: Entry) -> Outcome | None:
        """An outcome dead-lettering `entry` if it was delivered too often, else None."""
        info = await self.stream.pending_info([entry.entry_id])
        pending = info.get(entry.entry_id)
        deliveries = pending.deliveries if pending else 0
        if deliveries <= self.max_deliveries:
            return None
        parked = Outcome()
        self._park(entry, deliveries, parked)
        return parked

    def _park(self, entry: Entry, deliveries: int, parked: Outcome) -> None:
        error = DeadLettered(
            f"request failed on {deliveries - 1} deliveries and was dead-lettered",
            deliveries=deliveries - 1,
        )
        logger.warning(
            "dead-lettering entry %s after %d deliveries", entry.entry_id, deliveries - 1
        )
        parked.acks.append(entry.entry_id)
        parked.dead_letter(entry, error)
        self.dead_lettered_total += 1
        try:
            request = entry.request()
        except MalformedMessage:
            return
        parked.error(request.client_id, request.request_id, error)

    async def prune_if_due(self) -> int:
        """Prune dead consumers and stale live-set members, at most every few seconds."""
        if not self.dead_consumer_idle_ms or time.monotonic() < self._next_prune_s:
            return 0
        self._next_prune_s = time.monotonic() + min(max(self.dead_consumer_idle_ms / 10_000, 1), 60)
        pruned = 0
        for name, pending, idle_ms in await self.stream.consumers():
            if name == self.stream.consumer or pending or idle_ms < self.dead_consumer_idle_ms:
                continue
            if await self.stream.delete_consumer_if_idle(name):
                logger.info("deleted consumer %s, idle %d ms with nothing pending", name, idle_ms)
                pruned += 1
        oldest_ms = int(time.time() * 1000) - self.dead_consumer_idle_ms
        await self.stream.redis.zremrangebyscore(
            self.keys.model_workers(self.model), "-inf", f"({oldest_ms}"
        )
        self.pruned_total += pruned
        return pruned
