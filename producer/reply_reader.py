"""`ReplyReader`: the one task per client that turns its reply stream into settled futures.

It blocks on XREAD of the client's own reply stream (no consumer group: the stream has one
reader), settles each reply's request, and trims what it has read in the same round trip as
the next read. A broken or silent connection is retried with backoff; replies written
meanwhile wait in the stream.

A Redis that restarted without persistence has lost every queued request, and the connection
pool reconnects to it silently, so no error need ever reach this task. The reader therefore
watches the server's identity (``INFO server`` ``run_id``, checked in the read pipeline about
once a second and after every connection error; on a Redis Cluster, the run ids of all masters,
so a failover counts as a restart: see `server_run_id`) and, when it changes, asks for every
in-flight request to be submitted again. A request answered twice is settled once; a mere
reconnect to the same server resubmits nothing, so a network blip does not double the backlog.

Claim-check replies (a cache key instead of the vector) of one read are resolved together by
a `ClaimResolver`, one MGET on the cache instance; the requests whose keys are gone are handed
to ``on_claim_missed`` to be asked again for inline replies.

Three ways to read, fastest first. Where Redis is plain TCP or a Unix socket (a single
instance or a cluster) a `ReplyThread` reads, resolves claims and widens float16 vectors on a
thread of its own, and the next read is asked for before the last one's replies are settled,
so receiving overlaps the programs that consume them. A read the thread was redirected from
(a cluster slot migrating) goes through a `SlotPipe` (a `RespPipe` aimed at the node serving
the reply stream), which receives vectors in place on the event loop; over TLS redis-py
reads. The loop settles every read the same way (`ReplyBatch`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from lmqueue.shared import stage_trace
from lmqueue.shared.backoff import Backoff
from lmqueue.shared.cluster_targets import node_target
from lmqueue.shared.connections import bounded, is_cluster
from lmqueue.shared.errors import Unavailable
from lmqueue.shared.redis_errors import REDIS_DOWN
from lmqueue.shared.wire import Reply

from .claims import ClaimResolver
from .inflight import InflightTable
from .reply_batch import ReplyBatch, after, decode_entries, run_id_of
from .reply_thread import ReplyRedirected, ReplyThread
from .resp_pipe import RespPipe
from .slot_pipe import SlotPipe

__all__ = ["ReplyReader", "server_run_id", "BLOCK_MS"]

logger = logging.getLogger(__name__)

#: How long one read blocks for new replies.
BLOCK_MS = 1000
#: How often the server's identity is checked while all is well.
_IDENTITY_CHECK_S = 1.0


async def server_run_id(redis: Any) -> str:
    """The identity of the Redis process behind `redis`; it changes on every restart.

    On a cluster, the run ids of all masters, sorted: a failover (the promoted replica is
    another process, and may lack what its master had not yet replicated), a master's restart
    or a new master changes it.
    """
    if is_cluster(redis):
        infos = await redis.info("server", target_nodes=redis.PRIMARIES)
        return ",".join(sorted(str(info["run_id"]) for info in infos.values()))
    return str((await redis.info("server"))["run_id"])


class ReplyReader:
    """Reads one reply stream and settles the requests of an `InflightTable`.

    Args:
        on_restart: called when the server turns out to be a new process (restarted).
        pipe: the connection replies are read on, on the loop; None reads through `redis`.
        thread: reads on a thread of its own instead (takes precedence over `pipe`).
        claims: resolves claim-check replies; None treats every claim as missed.
        on_claim_missed: called with the ids of pending requests whose claimed results were
            gone, to ask for them again inline.
        run_id: the server's identity when the client connected.
        stall_timeout_s: a read unanswered this long past its block time is abandoned and
            retried on a new connection (the server or the path to it went silent).
    """

    def __init__(
        self,
        redis: Any,
        stream: str,
        inflight: InflightTable,
        on_restart: Callable[[], None],
        read_count: int = 256,
        run_id: str | None = None,
        stall_timeout_s: float = 10.0,
        claims: ClaimResolver | None = None,
        on_claim_missed: Callable[[list[str]], None] | None = None,
        pipe: RespPipe | SlotPipe | None = None,
        thread: ReplyThread | None = None,
    ) -> None:
        self.redis = redis
        self._cluster = is_cluster(redis)
        self.pipe = pipe
        self.thread = thread
        self.stream = stream
        self.inflight = inflight
        self.on_restart = on_restart
        self.claims = claims
        self.on_claim_missed = on_claim_missed
        self.read_count = read_count
        self.run_id = run_id
        self.stall_timeout_s = stall_timeout_s
        self.replies_read = 0
        self.reconnects = 0
        self.restarts_seen = 0
        self._last_id = "0-0"
        self._next_check_s = 0.0

    async def run(self) -> None:
        """Read forever (cancel to stop).

        On the reply thread the next read is under way while a read's replies are settled.
        """
        backoff = Backoff()
        timeout_s = BLOCK_MS / 1000 + self.stall_timeout_s
        reading: asyncio.Future[ReplyBatch] | None = None
        try:
            while True:
                if reading is None:
                    reading = asyncio.ensure_future(self._read())
                try:
                    batch = await bounded(reading, timeout_s, "reply stream read")
                except REDIS_DOWN as exc:
                    if not backoff.failing:
                        logger.warning("reply stream read failed (%s); reconnecting", exc)
                    self._next_check_s = 0.0  # who answers next may be a new server
                    reading = None
                    await backoff.wait()
                    continue
                except Exception:  # never let the only reader die; deadlines bound the damage
                    logger.exception("reading replies failed; retrying")
                    reading = None
                    await backoff.wait()
                    continue
                if backoff.reset():
                    self.reconnects += 1
                    logger.info("reply stream reconnected")
                if batch.last_id is not None:
                    self._last_id = batch.last_id
                reading = None
                if self.thread is not None:  # the next read, under way while these settle
                    reading = asyncio.ensure_future(self._read())
                    await asyncio.sleep(0)  # it starts now: submitted to the thread
                await self._take(batch)
        finally:
            if reading is not None:
                reading.cancel()

    async def _read(self) -> ReplyBatch:
        """Trim what was read, check the server when due, block for new replies: one trip."""
        check = time.monotonic() >= self._next_check_s
        trim = after(self._last_id) if self._last_id != "0-0" else None
        if self.thread is not None:
            batch = await self._read_thread(self.thread, trim, check)
        else:
            read = self._read_pipe if self.pipe is not None else self._read_redis_py
            batch = await read(trim, check)
        if batch.run_id is not None:
            self._next_check_s = time.monotonic() + _IDENTITY_CHECK_S
            self._observe(batch.run_id)
        return batch

    async def _read_thread(self, thread: ReplyThread, trim: str | None, check: bool) -> ReplyBatch:
        """A read on the reply thread; on a cluster, the masters' identities come through
        redis-py, and a read the thread was redirected from goes through the slot pipe."""
        run_id = await server_run_id(self.redis) if check and self._cluster else None
        aim = None
        if thread.needs_aim:
            node = self.redis.get_node_from_key(self.stream)
            aim = node_target(self.redis, node.host, node.port)
        try:
            batch = await thread.read(
                self.stream, self._last_id, trim, check and not self._cluster, self.read_count,
                BLOCK_MS, aim,
            )  # fmt: skip
        except ReplyRedirected:  # ASK: the slot is migrating, which the slot pipe follows
            read = self._read_pipe if self.pipe is not None else self._read_redis_py
            batch = await read(trim, False)
        if run_id is not None:
            batch.run_id = run_id
        return batch

    async def _read_pipe(self, trim: str | None, check: bool) -> ReplyBatch:
        assert self.pipe is not None
        # on a cluster the pipe reaches one node; the masters' identities come through redis-py
        run_id = await server_run_id(self.redis) if check and self._cluster else None
        inline_check = check and not self._cluster
        commands: list[tuple[Any, ...]] = []
        if trim is not None:
            commands.append(("XTRIM", self.stream, "MINID", trim))
        if inline_check:
            commands.append(("INFO", "server"))
        commands.append(("XREAD", "COUNT", self.read_count, "BLOCK", BLOCK_MS, "STREAMS",
                         self.stream, self._last_id))  # fmt: skip
        results = await self.pipe.execute(*commands)
        for result in results:
            if isinstance(result, Exception):
                raise result
        if inline_check:
            run_id = run_id_of(results[-2])
        batch = ReplyBatch(run_id=run_id)
        return decode_entries(results[-1][0][1], batch) if results[-1] else batch

    async def _read_redis_py(self, trim: str | None, check: bool) -> ReplyBatch:
        # a cluster pipeline sends commands to their keys' nodes: INFO of every master goes apart
        run_id = await server_run_id(self.redis) if check and self._cluster else None
        async with self.redis.pipeline(transaction=False) as pipe:
            if trim is not None:
                pipe.xtrim(self.stream, minid=trim, approximate=False)
            if check and not self._cluster:
                pipe.info("server")
            pipe.xread({self.stream: self._last_id}, count=self.read_count, block=BLOCK_MS)
            results = await pipe.execute()
        if check and not self._cluster:
            run_id = str(results[-2]["run_id"])
        reply = results[-1]
        batch = ReplyBatch(run_id=run_id)
        return decode_entries(reply[0][1], batch) if reply else batch

    def _observe(self, run_id: str) -> None:
        """Note the server's identity; a new one means Redis restarted."""
        if self.run_id is not None and run_id != self.run_id:
            self.restarts_seen += 1
            logger.warning(
                "Redis restarted (run_id %s -> %s); resubmitting %d in-flight requests",
                self.run_id[:8], run_id[:8], len(self.inflight),
            )  # fmt: skip
            self.on_restart()
        self.run_id = run_id

    async def _take(self, batch: ReplyBatch) -> None:
        """Settle a read's replies; resolve its claim-checks (unless the thread did)."""
        stage_trace.mark("replies", batch.read)
        self.replies_read += batch.read
        for entry_id, exc in batch.malformed:
            request_id = exc.data.get("request_id")
            logger.warning("undecodable reply %s: %s", entry_id, exc.message)
            if isinstance(request_id, str):
                self.inflight.fail(request_id, exc)
        inflight = self.inflight
        for reply in batch.ready:
            inflight.resolve(reply)
        if batch.found or batch.missed:
            if self.claims is not None:
                self.claims.record(batch.found, len(batch.missed))
            self._missed(batch.missed)
        claimed = [r for r in batch.claims if self._waiting(r)]
        if claimed:
            await self._resolve_claims(claimed)
        stage_trace.mark("settled")

    def _waiting(self, reply: Reply) -> bool:
        """Whether a claim-check's request still waits (else it is a duplicate)."""
        if self.inflight.get(reply.request_id) is not None:
            return True
        self.inflight.duplicate_replies += 1
        return False

    async def _resolve_claims(self, claimed: list[Reply]) -> None:
        """Fetch the claimed vectors (one MGET); ask again inline for those that are gone."""
        found, missed = await self.claims.fetch(claimed) if self.claims else ([], claimed)
        for reply in found:
            self.inflight.resolve(reply)
        self._missed(missed)

    def _missed(self, missed: list[Reply]) -> None:
        """Ask again inline for requests whose claimed results were gone."""
        missed = [reply for reply in missed if self._waiting(reply)]
        if not missed:
            return
        if self.on_claim_missed is not None:
            self.on_claim_missed([reply.request_id for reply in missed])
            return
        for reply in missed:  # nobody to ask again: still one outcome each
            self.inflight.fail(reply.request_id, Unavailable("the claimed result was gone"))
