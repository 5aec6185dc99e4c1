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

Replies are read through a `RespPipe` where one can connect (not TLS; on a cluster a `SlotPipe`
aims it at the node serving the reply stream): vectors are received straight into the arrays
handed out, instead of being copied five times by redis-py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from lmqueue.shared.backoff import Backoff
from lmqueue.shared.connections import bounded, is_cluster
from lmqueue.shared.errors import MalformedMessage, Unavailable
from lmqueue.shared.redis_errors import REDIS_DOWN
from lmqueue.shared.wire import Reply, decode_reply

from .claims import ClaimResolver
from .inflight import InflightTable
from .resp_pipe import RespPipe
from .slot_pipe import SlotPipe

__all__ = ["ReplyReader", "server_run_id"]

logger = logging.getLogger(__name__)

_BLOCK_MS = 1000
#: How often the server's identity is checked while all is well.
_IDENTITY_CHECK_S = 1.0


def _pairs(flat: list[Any]) -> dict[bytes, Any]:
    """A stream entry's fields from the flat [name, value, name, value, ...] of RESP."""
    items = iter(flat)
    return dict(zip(items, items, strict=False))  # Redis always sends them in pairs


def _run_id_of(info: Any) -> str:
    """The ``run_id`` line of an ``INFO server`` reply."""
    for line in bytes(info).split(b"\r\n"):
        if line.startswith(b"run_id:"):
            return line[7:].decode()
    raise ValueError("INFO server lacks run_id")


def _after(entry_id: bytes | str) -> str:
    """The smallest stream id greater than `entry_id`."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, seq = text.split("-")
    return f"{ms}-{int(seq) + 1}"


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
        pipe: the connection replies are read on; None reads through `redis` (redis-py).
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
    ) -> None:
        self.redis = redis
        self._cluster = is_cluster(redis)
        self.pipe = pipe
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
        """Read forever (cancel to stop)."""
        backoff = Backoff()
        while True:
            try:
                entries = await bounded(
                    self._read(), _BLOCK_MS / 1000 + self.stall_timeout_s, "reply stream read"
                )
            except REDIS_DOWN as exc:
                if not backoff.failing:
                    logger.warning("reply stream read failed (%s); reconnecting", exc)
                self._next_check_s = 0.0  # who answers next may be a new server
                await backoff.wait()
                continue
            except Exception:  # never let the only reader die; deadlines bound the damage
                logger.exception("reading replies failed; retrying")
                await backoff.wait()
                continue
            if backoff.reset():
                self.reconnects += 1
                logger.info("reply stream reconnected")
            claimed = self._settle(entries)
            if claimed:
                await self._resolve_claims(claimed)

    async def _read(self) -> list[tuple[Any, dict[bytes, Any]]]:
        """Trim what was read, check the server when due, block for new replies: one trip."""
        check = time.monotonic() >= self._next_check_s
        trim = _after(self._last_id) if self._last_id != "0-0" else None
        read = self._read_pipe if self.pipe is not None else self._read_redis_py
        run_id, entries = await read(trim, check)
        if run_id is not None:
            self._next_check_s = time.monotonic() + _IDENTITY_CHECK_S
            self._observe(run_id)
        return entries

    async def _read_pipe(self, trim: str | None, check: bool) -> tuple[str | None, list[Any]]:
        assert self.pipe is not None
        # on a cluster the pipe reaches one node; the masters' identities come through redis-py
        run_id = await server_run_id(self.redis) if check and self._cluster else None
        inline_check = check and not self._cluster
        commands: list[tuple[Any, ...]] = []
        if trim is not None:
            commands.append(("XTRIM", self.stream, "MINID", trim))
        if inline_check:
            commands.append(("INFO", "server"))
        commands.append(("XREAD", "COUNT", self.read_count, "BLOCK", _BLOCK_MS, "STREAMS",
                         self.stream, self._last_id))  # fmt: skip
        results = await self.pipe.execute(*commands)
        for result in results:
            if isinstance(result, Exception):
                raise result
        if inline_check:
            run_id = _run_id_of(results[-2])
        if not results[-1]:
            return run_id, []
        entries = results[-1][0][1]
        return run_id, [(entry_id, _pairs(fields)) for entry_id, fields in entries]

    async def _read_redis_py(self, trim: str | None, check: bool) -> tuple[str | None, list[Any]]:
        # a cluster pipeline sends commands to their keys' nodes: INFO of every master goes apart
        run_id = await server_run_id(self.redis) if check and self._cluster else None
        async with self.redis.pipeline(transaction=False) as pipe:
            if trim is not None:
                pipe.xtrim(self.stream, minid=trim, approximate=False)
            if check and not self._cluster:
                pipe.info("server")
            pipe.xread({self.stream: self._last_id}, count=self.read_count, block=_BLOCK_MS)
            results = await pipe.execute()
        if check and not self._cluster:
            run_id = str(results[-2]["run_id"])
        reply = results[-1]
        return run_id, list(reply[0][1]) if reply else []

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

    def _settle(self, entries: list[tuple[Any, dict[bytes, bytes]]]) -> list[Reply]:
        """Settle each reply's request; return the claim-checks of requests still waiting."""
        claimed = []
        for entry_id, fields in entries:
            self._last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            self.replies_read += 1
            try:
                reply = decode_reply(fields)
            except MalformedMessage as exc:
                request_id = exc.data.get("request_id")
                logger.warning("undecodable reply %s: %s", self._last_id, exc.message)
                if isinstance(request_id, str):
                    self.inflight.fail(request_id, exc)
                continue
            if reply.claim is None:
                self.inflight.resolve(reply)
            elif self.inflight.get(reply.request_id) is not None:
                claimed.append(reply)
            else:
                self.inflight.duplicate_replies += 1
        return claimed

    async def _resolve_claims(self, claimed: list[Reply]) -> None:
        """Fetch the claimed vectors (one MGET); ask again inline for those that are gone."""
        found, missed = await self.claims.fetch(claimed) if self.claims else ([], claimed)
        for reply in found:
            self.inflight.resolve(reply)
        if not missed:
            return
        if self.on_claim_missed is not None:
            self.on_claim_missed([reply.request_id for reply in missed])
            return
        for reply in missed:  # nobody to ask again: still one outcome each
            self.inflight.fail(reply.request_id, Unavailable("the claimed result was gone"))
