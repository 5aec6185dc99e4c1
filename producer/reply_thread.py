"""`ReplyThread`: a client's thread that receives its replies, off the event loop.

Receiving is the client's byte-moving work: 100-200 KB per reply, read from the reply stream
(inline replies) or the shared cache (claim-checks), and widened to float32 when it travelled
as float16. Here it happens on one thread of the client's own, in blocking calls with the GIL
released (`RespSocket`: vectors are received straight into the arrays handed out), while the
event loop runs the programs that consume them. One read is one job: trim what was read,
check the server's identity when due, block for new replies; decode them; fetch the vectors
of claim-checks (one MGET on a single instance; on a cluster one pipeline of GETs a master,
all sent before any is read), float16 ones widened as each arrives (`HalfWidener`: from one
reused buffer, still in the CPU's cache); widen any other float16 vectors. The loop settles
what comes back (`ReplyReader`), and has asked for the next read by then.

On a Redis Cluster the loop says where things are, from its redis-py client's slot map: the
master of the reply stream (`aim`, when the thread has none: at first and after a lost
connection) and a snapshot of the cache's map (`SlotTargets`). A ``MOVED`` for the reply
stream re-aims the thread at the node named; an ``ASK`` (the slot is migrating) raises
`ReplyRedirected`, and the loop reads that once through its slot pipe. Claims on a master
that redirected, refused or was lost stay unresolved in the batch for the loop, whose
redis-py client follows redirections and refreshes its map, and the snapshot is taken again
for the next read.

Its torch ops run serially (`shared.serial_torch`): no OpenMP team spins for it.
"""

from __future__ import annotations

import logging
from typing import Any

from lmqueue.shared.cluster_targets import SlotTargets
from lmqueue.shared.job_thread import JobThread
from lmqueue.shared.redis_errors import REDIS_DOWN
from lmqueue.shared.resp_socket import RespSocket, Target
from lmqueue.shared.serial_torch import serial_torch_here

from .claims import ClaimResolver
from .reply_batch import ReplyBatch, decode_entries, run_id_of
from .slot_pipe import redirect_of
from .tensors import HalfWidener, widened

__all__ = ["ReplyRedirected", "ReplyThread"]

logger = logging.getLogger(__name__)


class ReplyRedirected(Exception):
    """The reply stream's master answered ASK, or redirected twice: read it another way once."""


class ReplyThread:
    """One client's reply-receiving thread and its blocking connections.

    Args:
        replies: where the reply stream is (the queue instance); None on a cluster, where the
            loop aims each read that needs it (`needs_aim`).
        cache: where claimed vectors are: an instance, a cluster's `SlotTargets`, or None
            (claims are not resolved here).
        read_timeout_s: a read that makes no progress this long fails (beyond its block).
        keep_float16: hand float16 vectors out as they came (`widened`).
    """

    def __init__(
        self,
        replies: Target | None,
        cache: Target | SlotTargets | None,
        claims: ClaimResolver,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 11.0,
        keep_float16: bool = False,
    ) -> None:
        self.claims = claims
        #: Whether float16 vectors stay float16 (the client's ``half_results``).
        self.keep_float16 = keep_float16
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.replies = RespSocket(replies, connect_timeout_s, read_timeout_s) if replies else None
        #: A cluster cache's slot map, as the loop last took it (None: one instance, or none).
        self.slots = cache if isinstance(cache, SlotTargets) else None
        self.cache = (
            RespSocket(cache, connect_timeout_s, claims.timeout_s)
            if cache is not None and not isinstance(cache, SlotTargets)
            else None
        )
        self._cluster_replies = replies is None
        self._nodes: dict[tuple[str, int], RespSocket] = {}  # a cluster cache's masters
        #: MOVED or ASK answers met (the reply stream's or claims').
        self.redirects = 0
        self._thread = JobThread("lmq-replies")
        #: Widens claimed float16 vectors as they arrive (None: kept float16, or no size).
        self._widener = (
            HalfWidener(claims.vector_size) if claims.vector_size and not keep_float16 else None
        )

    @property
    def needs_aim(self) -> bool:
        """Whether the next read must be told where the reply stream is (a cluster's, at first
        or after its master was lost)."""
        return self.replies is None

    async def read(
        self,
        stream: str,
        last_id: str,
        trim: str | None,
        check: bool,
        count: int,
        block_ms: int,
        aim: Target | None = None,
    ) -> ReplyBatch:
        """One read of `stream` after `last_id`, decoded, claims resolved, vectors widened.

        `aim`: the reply stream's master, where `needs_aim`. Claims the thread could not read
        on a cluster stay in the batch's ``claims``.

        Raises:
            redis.exceptions.ConnectionError, TimeoutError: the queue could not be read (the
                cache failing only makes its claims miss).
            ReplyRedirected: the reply stream's master answered ASK (or redirected twice).
        """
        table = self.slots.table() if self.slots is not None else None
        return await self._thread.run(
            self._read, stream, last_id, trim, check, count, block_ms, aim, table
        )

    def close(self) -> None:
        """End the thread: a read under way is cut short, then the connections close."""
        if not self._thread.running:
            return
        for sock in self._sockets():
            sock.interrupt()
        self._thread.close(last=self._close_sockets)

    def _sockets(self) -> list[RespSocket]:
        sockets = [self.replies, self.cache, *self._nodes.values()]
        return [sock for sock in sockets if sock is not None]

    def _close_sockets(self) -> None:
        for sock in self._sockets():
            sock.close()
        self._nodes.clear()

    # -- on the thread ---------------------------------------------------------------------------
    def _read(
        self,
        stream: str,
        last_id: str,
        trim: str | None,
        check: bool,
        count: int,
        block_ms: int,
        aim: Target | None,
        table: list[Target | None] | None,
    ) -> ReplyBatch:
        serial_torch_here()
        commands: list[tuple[Any, ...]] = []
        if trim is not None:
            commands.append(("XTRIM", stream, "MINID", trim))
        if check:
            commands.append(("INFO", "server"))
        commands.append(("XREAD", "COUNT", count, "BLOCK", block_ms, "STREAMS", stream, last_id))
        results = self._read_replies(commands, aim)
        for result in results:
            if isinstance(result, Exception):
                raise result
        batch = ReplyBatch(run_id=run_id_of(results[-2]) if check else None)
        if results[-1]:
            decode_entries(results[-1][0][1], batch)
        if batch.claims:
            claims = batch.claims
            values = self._claimed(claims, table, self._intake_for(claims))
            read = [i for i, value in enumerate(values) if value is not _UNREAD]
            found, batch.missed = self.claims.match(
                [claims[i] for i in read], [values[i] for i in read]
            )
            batch.ready.extend(found)
            batch.found = len(found)
            batch.claims = [claims[i] for i, value in enumerate(values) if value is _UNREAD]
        keep = self.keep_float16
        batch.ready = [widened(reply, keep) for reply in batch.ready]
        return batch

    def _read_replies(self, commands: list[tuple[Any, ...]], aim: Target | None) -> list[Any]:
        """The reply stream's pipeline, on its master on a cluster (a MOVED followed once)."""
        if aim is not None and self.replies is None:
            self.replies = RespSocket(aim, self.connect_timeout_s, self.read_timeout_s)
        if self.replies is None:
            raise ReplyRedirected("the reply stream's master is not known yet")
        try:
            results = self.replies.execute(commands)
            redirect = redirect_of(results) if self._cluster_replies else None
            if redirect is not None:
                self.redirects += 1
                kind, host, port = redirect
                if kind == "ASK":
                    raise ReplyRedirected(f"ASK {host}:{port}")
                self.replies.close()
                self.replies = RespSocket(
                    {**self.replies.target, "host": host, "port": port},
                    self.connect_timeout_s, self.read_timeout_s,
                )  # fmt: skip
                results = self.replies.execute(commands)
                if redirect_of(results) is not None:
                    raise ReplyRedirected("redirected twice; the slot map is changing")
        except _READ_FAILURES:
            if self._cluster_replies and self.replies is not None:  # aimed afresh next time
                self.replies.close()
                self.replies = None
            raise
        return results

    def _intake_for(self, claims: list[Any]) -> HalfWidener | None:
        """The widener, where every claim is of a float16 vector: a value of a float16
        vector's length then is one (`ClaimResolver.match` checks the claim's dtype again)."""
        widener = self._widener
        if widener is None or any(reply.dtype != "float16" for reply in claims):
            return None
        return widener

    def _claimed(
        self, claims: list[Any], table: list[Target | None] | None, intake: HalfWidener | None
    ) -> list[Any]:
        """The claimed values (None: missing; float16 vectors widened where `intake`),
        `_UNREAD` where a cluster's master could not answer; all missing if one instance's
        cache cannot be read."""
        if table is not None:
            return self._cluster_gets(claims, table, intake)
        if self.cache is None:
            return [None] * len(claims)
        try:
            (values,) = self.cache.execute([("MGET", *(reply.claim for reply in claims))], intake)
        except Exception as exc:  # the inline path does not need the cache
            logger.warning("reading %d claimed results failed: %s", len(claims), exc)
            return [None] * len(claims)
        if isinstance(values, Exception):
            logger.warning("reading %d claimed results failed: %s", len(claims), values)
            return [None] * len(claims)
        return list(values)

    def _cluster_gets(
        self, claims: list[Any], table: list[Target | None], intake: HalfWidener | None
    ) -> list[Any]:
        """GETs of the claims' keys, one pipeline a master, every pipeline sent before any
        answer is read; a key its master redirects or refuses, and every key of a master that
        fails, stays `_UNREAD`, and the snapshot stale."""
        values: list[Any] = [_UNREAD] * len(claims)
        groups: dict[int, tuple[Target, list[int], list[bytes]]] = {}
        for index, reply in enumerate(claims):
            raw = reply.claim if isinstance(reply.claim, bytes) else str(reply.claim).encode()
            target = SlotTargets.of(table, raw)
            if target is not None:
                group = groups.setdefault(id(target), (target, [], []))
                group[1].append(index)
                group[2].append(raw)
        sent = []
        for target, indexes, raws in groups.values():
            sock = self._node(target)
            try:
                sock.send([("GET", raw) for raw in raws])
            except REDIS_DOWN as exc:
                self._lost(target, exc)
                continue
            sent.append((target, sock, indexes))
        for target, sock, indexes in sent:
            try:
                answers = sock.receive(len(indexes), intake)
            except REDIS_DOWN as exc:
                self._lost(target, exc)
                continue
            for index, answer in zip(indexes, answers, strict=True):
                if isinstance(answer, Exception):  # MOVED, ASK (a slot moved), or refused
                    self.redirects += str(answer).startswith(("MOVED ", "ASK "))
                else:
                    values[index] = answer
        if any(value is _UNREAD for value in values) and self.slots is not None:
            self.slots.stale = True
        return values

    def _node(self, target: Target) -> RespSocket:
        address = (target["host"], int(target["port"]))
        sock = self._nodes.get(address)
        if sock is None:
            sock = self._nodes[address] = RespSocket(
                target, self.connect_timeout_s, self.claims.timeout_s
            )
        return sock

    def _lost(self, target: Target, exc: BaseException) -> None:
        logger.info("reading claims on %s:%s failed: %s", target["host"], target["port"], exc)
        sock = self._nodes.pop((target["host"], int(target["port"])), None)
        if sock is not None:
            sock.close()


#: What ends a read of the reply stream and, on a cluster, its aim.
_READ_FAILURES: tuple[type[BaseException], ...] = (*REDIS_DOWN, ReplyRedirected)
#: A claim a cluster's master could not answer: the loop resolves it.
_UNREAD: Any = object()
