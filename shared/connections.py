"""Redis connections configured for streams, and a watchdog for reads that may never return.

Blocking stream reads (XREAD/XREADGROUP BLOCK) must not be cut by a socket timeout, so command
sockets have none; connecting is bounded instead, idle connections are health-checked before
reuse (a Redis restart surfaces as one ConnectionError, not a hang), and the kernel gives up on
a peer that vanished from the network (keepalive probes, ``TCP_USER_TIMEOUT``) in about half a
minute.

A peer whose kernel still acknowledges but that never answers (a frozen Redis, a userspace
proxy that lost its upstream) passes those checks, so the calls every request depends on (a
client's reply reads and sends, a worker's request reads and reply writes) run in `bounded`
and are retried on a fresh connection. Not a socket timeout, and not ``asyncio.timeout``: on
3.11 redis-py's zero-delay timeouts can leave a task's cancel count one too high, and an
enclosing timeout then turns a real cancellation into a TimeoutError, so the task never stops
(reproduced: 10 of 40 cancellations of a reader with ``socket_timeout=10`` were swallowed).

TCP connections send each command's pieces with one ``sendmsg`` instead of joining them: a
worker's reply pipeline is 32 vectors, 6 MB, and Python 3.11's ``writelines`` copies all of it
into one new buffer first (a fresh mapping, page faults included, under a fixed mmap
threshold). Python 3.12+ does this itself.

Redis Cluster is a deployment choice, not a flag: `connect_async_redis` and `sync_redis` ask the
node named by the ordinary ``redis://``/``rediss://`` URL ``INFO cluster`` once, at connect time,
and return a redis-py cluster client (``RedisCluster``: follows MOVED and ASK, refreshes the slot
map after a failover; asyncio: a `RecoveringCluster`, which also finds the cluster again when
redis-py has lost every node, see `shared.cluster_client`) when it says ``cluster_enabled:1``,
the plain client otherwise. Nothing wraps the plain client, so a single instance pays one round
trip at connect and nothing per command. The asyncio cluster client's nodes use the vectored
connection too; its pipelines split per node (``transaction=False`` only: callers that need
atomicity use one hash slot and a Lua script, see `shared.keys`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar, cast

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.cluster as synccluster
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .cluster_client import RecoveringCluster
from .cluster_gets import ClusterGets
from .resp_encoding import pack_commands

__all__ = [
    "async_redis",
    "connect_async_redis",
    "sync_redis",
    "bounded",
    "tune_socket",
    "is_cluster",
    "cluster_enabled",
    "multi_get",
    "slot_groups",
    "execute_pipeline",
]

T = TypeVar("T")
K = TypeVar("K", str, bytes)

logger = logging.getLogger(__name__)

#: Probe an idle connection after 10 s, every 5 s, give up after 3 unanswered probes; give up
#: on data unacknowledged for 30 s (Linux names; options a platform lacks are left out).
_KEEPALIVE = {
    option: value
    for name, value in (
        ("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3),
        ("TCP_USER_TIMEOUT", 30_000),
    )
    if (option := getattr(socket, name, None)) is not None
}  # fmt: skip


def _options(connect_timeout_s: float) -> dict[str, Any]:
    return {
        "connection_class": _VectoredConnection,  # redis:// only: rediss:// and unix:// keep theirs
        "socket_timeout": None,
        "socket_connect_timeout": connect_timeout_s,
        "socket_keepalive": True,
        "socket_keepalive_options": _KEEPALIVE,
        "health_check_interval": 15,
        "max_connections": 64,
    }


def tune_socket(sock: socket.socket) -> None:
    """Give a TCP socket of our own the options redis-py's get: no Nagle delay, keepalive."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in _KEEPALIVE.items():
        sock.setsockopt(socket.IPPROTO_TCP, option, value)


def async_redis(url: str, connect_timeout_s: float = 5.0) -> aioredis.Redis:
    """An asyncio client of the Redis at `url` (connects lazily, on first command)."""
    return aioredis.Redis.from_url(url, **_options(connect_timeout_s))


async def connect_async_redis(
    url: str, connect_timeout_s: float = 5.0
) -> aioredis.Redis | aiocluster.RedisCluster:
    """An asyncio client of the Redis at `url`: a cluster client if the node is in a cluster.

    Asks ``INFO cluster`` once. If the node cannot be reached, the plain client is returned
    as it is (it connects lazily, and callers retry as they did before), and that is logged at
    info level: the caller's own failure to connect is what a user needs to see, once.
    """
    plain = async_redis(url, connect_timeout_s)
    try:
        info = await bounded(plain.info("cluster"), connect_timeout_s + 1, "INFO cluster")
    except Exception as exc:  # unreachable now: keep today's lazy single-instance behaviour
        logger.info("could not ask %s whether it is a cluster node (%s)", _where(url), exc)
        return plain
    if not cluster_enabled(info):
        return plain
    await plain.aclose()
    options = _cluster_options(connect_timeout_s)
    client = RecoveringCluster.from_url(url, **options)
    if not url.startswith("rediss://"):
        # RedisCluster takes no connection class, but every node it discovers (now or after a
        # failover) is made from these arguments: vectored sends for the worker's pipelines
        client.nodes_manager.connection_kwargs["connection_class"] = _VectoredConnection
    await bounded(client.initialize(), connect_timeout_s + 1, "reading the cluster's slots")
    return client


def sync_redis(url: str, connect_timeout_s: float = 5.0) -> redis.Redis | synccluster.RedisCluster:
    """A blocking client of the Redis at `url`: a cluster client if the node is in a cluster."""
    options = _options(connect_timeout_s)
    del options["connection_class"]  # the blocking client already sends pieces one by one
    plain = redis.Redis.from_url(url, **options)
    try:
        info = plain.info("cluster")
    except redis.RedisError as exc:
        logger.info("could not ask %s whether it is a cluster node (%s)", _where(url), exc)
        return plain
    if not cluster_enabled(info):
        return plain
    plain.close()
    return synccluster.RedisCluster.from_url(url, **_cluster_options(connect_timeout_s))


def cluster_enabled(info: Any) -> bool:
    """Whether an ``INFO cluster`` reply (parsed or raw) says ``cluster_enabled:1``."""
    if isinstance(info, dict):
        return str(info.get("cluster_enabled", 0)) == "1"
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_enabled:1" in text


def is_cluster(client: Any) -> bool:
    """Whether `client` is a redis-py cluster client (asyncio or blocking)."""
    return isinstance(client, (aiocluster.RedisCluster, synccluster.RedisCluster))


def multi_get(client: Any) -> Callable[[Sequence[Any]], Awaitable[list[Any]]]:
    """The MGET of `client`: one command on a single instance; on an asyncio cluster, one
    pipeline of GETs per master, the masters asked concurrently (`ClusterGets`); on a
    synchronous one, redis-py's ``mget_nonatomic``. Chosen once, so a single instance pays
    nothing per call.
    """
    if isinstance(client, aiocluster.RedisCluster):
        return ClusterGets(client)
    if is_cluster(client):
        return client.mget_nonatomic
    return client.mget


def slot_groups(client: Any, keys: Iterable[K]) -> list[list[K]]:
    """`keys` grouped so that one multi-key command can name each group: all of them on a
    single instance; on a cluster, those sharing a hash slot (in first-seen order)."""
    keys = list(keys)
    if not is_cluster(client):
        return [keys] if keys else []
    groups: dict[int, list[K]] = {}
    for key in keys:
        raw = key if isinstance(key, bytes) else str(key).encode()
        groups.setdefault(key_slot(raw), []).append(key)
    return list(groups.values())


def _cluster_options(connect_timeout_s: float) -> dict[str, Any]:
    options = _options(connect_timeout_s)
    del options["connection_class"]  # cluster nodes make their own connections
    return options


def _where(url: str) -> str:
    """`url` without credentials, for logs."""
    return url.rsplit("@", 1)[-1]


_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 16
_HIGH_WATER_BYTES = 64 * 1024
_READ_BYTES = 64 * 1024
_JOINS_ON_WRITELINES = sys.version_info < (3, 12)


class _VectoredConnection(aioredis.Connection):
    """A TCP connection that hands a command's pieces to the kernel without joining them."""

    async def _connect(self) -> None:
        await super()._connect()
        transport: Any = self._writer.transport  # type: ignore[union-attr]
        # the transport resumes a paused writer only once it has flushed everything
        transport.set_write_buffer_limits(high=_HIGH_WATER_BYTES, low=0)
        # asyncio allocates its whole read size for every recv: 256 KiB by default, which a
        # worker's fixed mmap threshold (workers.main) turns into mmap + mremap + munmap each
        if hasattr(transport, "max_size"):  # CPython's selector transport; not uvloop's
            transport.max_size = _READ_BYTES

    async def can_read_destructive(self) -> bool:
        """Whether anything waits to be read (redis-py's pool asks before every command it
        hands out: a connection with data or an EOF is reconnected).

        redis-py answers by trying a read under a zero timeout: with nothing there (nearly
        always) the read is cancelled on the loop's next turn, 15-30 CPU us a command on this
        project's machine; and bytes or an EOF that reached the socket after the loop's last
        turn lose that race to the timeout, so a connection the server closed was handed out.
        Here, when nothing was buffered by the stream or its parser and no EOF seen, the
        socket itself is asked (a peek that does not wait, ~5 us); anything the stream or
        parser holds gets redis-py's own check.
        """
        stream, writer, parser = self._reader, self._writer, self._parser
        hiredis_reader = getattr(parser, "_reader", None)
        if (
            stream is not None
            and writer is not None
            and not getattr(stream, "_buffer", True)  # an asyncio.StreamReader's bytes held
            and not stream.at_eof()
            and stream.exception() is None
            and hiredis_reader is not None
            and not hiredis_reader.has_data()
        ):
            sock = writer.get_extra_info("socket")
            if sock is not None:
                waiting = _peek(sock)
                if waiting is None:
                    return False
                if not waiting:
                    raise RedisConnectionError("Connection closed by server.")
                return True
        return cast(bool, await super().can_read_destructive())

    def pack_command(self, *args: Any) -> list[bytes]:
        """A command of strings and bytes (a worker's MGET of a batch's cache keys, its
        XREADGROUP) packed by the project's packer (`resp_encoding.pack_commands`: small
        arguments in one join, each large one a piece of its own), where redis-py encodes each
        argument in a call of its own and joins the buffer again for each, ~2 us an argument
        on this project's machine. Anything else (numbers, memoryviews, a command name with a
        space, an encoding other than strict UTF-8) goes to redis-py's packer."""
        first = args[0] if args else None
        encoder = self.encoder
        if (
            type(first) is not str
            or " " in first
            or encoder.encoding != "utf-8"
            or encoder.encoding_errors != "strict"
            or not all(type(arg) is str or type(arg) is bytes for arg in args)
        ):
            return super().pack_command(*args)
        return cast(list[bytes], pack_commands((args,)))  # strings and bytes: bytes pieces

    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        if isinstance(command, (bytes, str)) or self.socket_timeout or not _JOINS_ON_WRITELINES:
            await super().send_packed_command(command, check_health)
            return
        if not self.is_connected:
            await self.connect()
        elif check_health:
            await self.check_health()
        try:
            await _send_vectored(self._writer, list(command))  # type: ignore[arg-type]
        except OSError as exc:
            await self.disconnect(nowait=True)
            raise RedisConnectionError(f"Error while writing to socket: {exc!r}") from exc
        except BaseException:  # a half-sent command leaves the connection unusable
            await self.disconnect(nowait=True)
            raise


def _peek(sock: Any) -> bytes | None:
    """A byte waiting on a socket the loop owns, without taking it or waiting: b"" at EOF,
    None if none. Read through a socket object over the same descriptor, detached after
    (asyncio's socket wrapper has no recv; a ``select`` would refuse descriptors past 1023)."""
    view = socket.socket(sock.family, sock.type, sock.proto, fileno=sock.fileno())
    try:
        return view.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:  # reset by the peer: as good as closed
        return b""
    finally:
        view.detach()  # the descriptor stays the transport's


async def _send_vectored(writer: asyncio.StreamWriter, pieces: list[Any]) -> None:
    """Send `pieces` in order, by ``sendmsg`` while the kernel takes them.

    When the socket is full, pieces go to the transport's buffer (copied once) until it holds
    64 KiB, and the send waits until the transport has flushed them all, so little is ever
    copied ahead of the kernel. Transports without a plain socket (TLS, uvloop) get
    ``writelines``.
    """
    transport = writer.transport
    sock = getattr(transport, "_sock", None)  # CPython's selector transport
    if not isinstance(sock, socket.socket):
        writer.writelines(pieces)
        await writer.drain()
        return
    views = [memoryview(piece).cast("B") for piece in pieces]
    first = 0
    while first < len(views):
        if not transport.get_write_buffer_size():
            try:
                sent = sock.sendmsg(views[first : first + _IOV_MAX])
            except (BlockingIOError, InterruptedError):
                sent = 0
            first = _advance(views, first, sent)
            if first == len(views):
                break
        writer.write(views[first])
        first += 1
        await writer.drain()
    await writer.drain()


def _advance(views: list[memoryview], first: int, sent: int) -> int:
    """Drop `sent` bytes from the front of ``views[first:]``; return the new first index."""
    while sent and first < len(views):
        size = len(views[first])
        if sent < size:
            views[first] = views[first][sent:]
            return first
        sent -= size
        first += 1
    return first


async def bounded(awaitable: Awaitable[T], timeout_s: float, what: str) -> T:
    """Await `awaitable` in a task of its own; past `timeout_s`, cancel it and raise.

    Cancelling a redis-py command closes its connection, so the caller's retry starts on a
    fresh one. The caller waits on a future of its own, never on the command's task, so
    neither the watchdog nor redis-py's handling of a cancellation (RELIABILITY.md) can cancel
    the caller or swallow the caller's own cancellation; a cancelled caller cancels the
    command and leaves at once. One timer and one done callback, not ``asyncio.wait``'s set
    and wrappers: about 3 us less a command (a batch of a worker awaits two or three).

    Raises:
        redis.exceptions.TimeoutError: if `awaitable` took longer than `timeout_s`.
    """
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(awaitable)
    waiter = loop.create_future()
    wake = functools.partial(_wake, waiter)
    task.add_done_callback(wake)
    timer = loop.call_later(timeout_s, wake)
    try:
        await waiter
    except BaseException:  # the caller was cancelled: so is the command, unless it ended
        _abandon(task, wake, timer)
        raise
    timer.cancel()
    if not task.done():
        _abandon(task, wake, timer)
        await asyncio.wait({task})
        raise RedisTimeoutError(f"{what} got no answer in {timeout_s:g} s")
    return task.result()


def _abandon(task: asyncio.Task[Any], wake: Any, timer: asyncio.TimerHandle) -> None:
    """Cancel `bounded`'s command (if it still runs), its timer, and see its outcome when it
    ends, whenever that is: an error it ended with is not reported as never retrieved."""
    timer.cancel()
    task.remove_done_callback(wake)
    task.add_done_callback(_retrieve)
    task.cancel()


def _wake(waiter: asyncio.Future[None], _task: object = None) -> None:
    """End `bounded`'s wait: its command is done, or its time is up (whichever comes first)."""
    if not waiter.done():
        waiter.set_result(None)


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Mark an abandoned task's outcome as seen (its caller already moved on)."""
    if not task.cancelled():
        task.exception()


async def execute_pipeline(pipe: Any, raise_on_error: bool = True) -> list[Any]:
    """``pipe.execute(raise_on_error)``, with one redis-py 5.3 cluster race made retryable.

    When a command of another task fails to connect, redis-py's asyncio cluster client closes
    its node manager to re-initialize, which clears the default node; a pipeline that starts
    meanwhile fails with AttributeError (``ClusterPipeline._execute`` reads the default node's
    name) instead of a connection error. Seen here when a master was killed mid-run: the
    worker's batch was abandoned instead of retried. It is raised as the connection error it
    stands for, which the caller's retry loop handles.
    """
    try:
        return list(await pipe.execute(raise_on_error=raise_on_error))
    except AttributeError as exc:
        if not isinstance(pipe, aiocluster.ClusterPipeline):
            raise
        raise RedisConnectionError(f"the cluster client was re-initializing: {exc}") from exc
