"""`ReplyThread`: a client's thread that receives its replies, off the event loop.

Receiving is the client's byte-moving work: 100-200 KB per reply, read from the reply stream
(inline replies) or the shared cache (claim-checks), and widened to float32 when it travelled
as float16. Here it happens on one thread of the client's own, in blocking calls with the GIL
released (`RespSocket`: vectors are received straight into the arrays handed out), while the
event loop runs the programs that consume them. One read is one job: trim what was read,
check the server's identity when due, block for new replies; decode them; fetch the vectors
of claim-checks with one MGET; widen float16 vectors. The loop settles what comes back
(`ReplyReader`), and has asked for the next read by then.

Its torch ops run serially (`shared.serial_torch`): no OpenMP team spins for it.
"""

from __future__ import annotations

import logging
from typing import Any

from lmqueue.shared.job_thread import JobThread
from lmqueue.shared.resp_socket import RespSocket, Target
from lmqueue.shared.serial_torch import serial_torch_here

from .claims import ClaimResolver
from .reply_batch import ReplyBatch, decode_entries, run_id_of
from .tensors import widened

__all__ = ["ReplyThread"]

logger = logging.getLogger(__name__)


class ReplyThread:
    """One client's reply-receiving thread and its two blocking connections.

    Args:
        replies: where the reply stream is (the queue instance).
        cache: where claimed vectors are (None: claims are not resolved here).
        read_timeout_s: a read that makes no progress this long fails (beyond its block).
        keep_float16: hand float16 vectors out as they came (`widened`).
    """

    def __init__(
        self,
        replies: Target,
        cache: Target | None,
        claims: ClaimResolver,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 11.0,
        keep_float16: bool = False,
    ) -> None:
        self.claims = claims
        #: Whether float16 vectors stay float16 (the client's ``half_results``).
        self.keep_float16 = keep_float16
        self.replies = RespSocket(replies, connect_timeout_s, read_timeout_s)
        self.cache = RespSocket(cache, connect_timeout_s, claims.timeout_s) if cache else None
        self._thread = JobThread("lmq-replies")

    async def read(
        self, stream: str, last_id: str, trim: str | None, check: bool, count: int, block_ms: int
    ) -> ReplyBatch:
        """One read of `stream` after `last_id`, decoded, claims resolved, vectors widened.

        Raises:
            redis.exceptions.ConnectionError, TimeoutError: the queue could not be read (the
                cache failing only makes its claims miss).
        """
        return await self._thread.run(self._read, stream, last_id, trim, check, count, block_ms)

    def close(self) -> None:
        """End the thread: a read under way is cut short, then the connections close."""
        if not self._thread.running:
            return
        self.replies.interrupt()
        if self.cache is not None:
            self.cache.interrupt()
        self._thread.close(last=self._close_sockets)

    def _close_sockets(self) -> None:
        self.replies.close()
        if self.cache is not None:
            self.cache.close()

    # -- on the thread ---------------------------------------------------------------------------
    def _read(
        self, stream: str, last_id: str, trim: str | None, check: bool, count: int, block_ms: int
    ) -> ReplyBatch:
        serial_torch_here()
        commands: list[tuple[Any, ...]] = []
        if trim is not None:
            commands.append(("XTRIM", stream, "MINID", trim))
        if check:
            commands.append(("INFO", "server"))
        commands.append(("XREAD", "COUNT", count, "BLOCK", block_ms, "STREAMS", stream, last_id))
        results = self.replies.execute(commands)
        for result in results:
            if isinstance(result, Exception):
                raise result
        batch = ReplyBatch(run_id=run_id_of(results[-2]) if check else None)
        if results[-1]:
            decode_entries(results[-1][0][1], batch)
        if batch.claims:
            found, batch.missed = self.claims.match(batch.claims, self._mget(batch.claims))
            batch.ready.extend(found)
            batch.found, batch.claims = len(found), []
        keep = self.keep_float16
        batch.ready = [widened(reply, keep) for reply in batch.ready]
        return batch

    def _mget(self, claims: list[Any]) -> list[Any]:
        """The claimed values (all missing if the cache cannot be read)."""
        if self.cache is None:
            return [None] * len(claims)
        try:
            (values,) = self.cache.execute([("MGET", *(reply.claim for reply in claims))])
        except Exception as exc:  # the inline path does not need the cache
            logger.warning("reading %d claimed results failed: %s", len(claims), exc)
            return [None] * len(claims)
        if isinstance(values, Exception):
            logger.warning("reading %d claimed results failed: %s", len(claims), values)
            return [None] * len(claims)
        return list(values)
