"""`Janitor`: takes over entries that a dead or stuck worker left pending.

A worker that dies mid-batch leaves its entries in the group's pending list. Any live worker's
janitor claims entries idle past `claim_idle_ms` (XAUTOCLAIM) and answers them itself. An
entry already delivered `max_deliveries` times is poison for workers (it kills or hangs them):
it is moved to the model's dead-letter stream and its client gets `DeadLettered`.
"""

from __future__ import annotations

import logging

from shared.errors import DeadLettered, MalformedMessage
from shared.keys import KeySpace
from shared.settings import WorkerSettings
from shared.wire import decode_request

from .outcome import Outcome
from .request_stream import Entry, RequestStream

__all__ = ["Janitor"]

logger = logging.getLogger(__name__)


class Janitor:
    """Reclaims idle pending entries of one request stream for its worker."""

    def __init__(self, stream: RequestStream, keys: KeySpace, settings: WorkerSettings) -> None:
        self.stream = stream
        self.keys = keys
        self.claim_idle_ms = settings.claim_idle_ms
        self.max_deliveries = settings.max_deliveries
        self.batch_size = settings.batch_size
        self.reclaimed_total = 0
        self.dead_lettered_total = 0

    async def sweep(self) -> tuple[list[Entry], Outcome]:
        """Claim idle entries; return those to answer, and an outcome parking the poison ones."""
        claimed = await self.stream.autoclaim(self.claim_idle_ms, self.batch_size)
        parked = Outcome()
        if not claimed:
            return [], parked
        info = await self.stream.pending_info([entry.entry_id for entry in claimed])
        retry = []
        for entry in claimed:
            pending = info.get(entry.entry_id)
            deliveries = pending.deliveries if pending else 0
            if deliveries > self.max_deliveries:
                self._park(entry, deliveries, parked)
            else:
                retry.append(entry)
        if retry:
            logger.info("reclaimed %d idle entries from dead consumers", len(retry))
        self.reclaimed_total += len(retry)
        return retry, parked

    def _park(self, entry: Entry, deliveries: int, parked: Outcome) -> None:
        error = DeadLettered(
            f"request failed on {deliveries - 1} deliveries and was dead-lettered",
            deliveries=deliveries - 1,
        )
        logger.warning("dead-lettering entry %s after %d deliveries", entry.entry_id, deliveries - 1)
        parked.acks.append(entry.entry_id)
        parked.dead_letter(entry, error)
        self.dead_lettered_total += 1
        try:
            request = decode_request(entry.fields)
        except MalformedMessage:
            return
        parked.error(request.client_id, request.request_id, error)
