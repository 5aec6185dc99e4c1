"""What the writer thread does with one batch's writes: commands, one pipeline per node.

`ReplyWriter` decides what is written and in which order; this module turns it into RESP
commands and runs them on the writer thread's blocking connections (`RespSocket`). Commands
are grouped by the connection their key routes to (`Routes`: the one instance, or a cluster's
masters); every group is sent before any answer is read, so the nodes of a cluster work on
one batch side by side. A ``MOVED`` or ``ASK`` answer means redis-py's slot map is out of
date: `Redirected` is raised and the batch is written through redis-py instead.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from lmqueue.shared import stage_trace
from lmqueue.shared.resp_socket import Target
from lmqueue.shared.settings import WorkerSettings
from lmqueue.shared.shared_cache import SharedCache
from lmqueue.shared.wire import payload_bytes

from .outcome import Outcome
from .writer_thread import WriterThread

__all__ = ["Redirected", "Routed", "reply_commands", "execute_routed", "put_routed", "routed_sets"]

logger = logging.getLogger(__name__)

#: A command and the connection it goes to.
Routed = tuple[Target, tuple[Any, ...]]


class Redirected(Exception):
    """Raised when a cluster node answered MOVED or ASK: a slot is served elsewhere now."""


def reply_commands(
    outcome: Outcome,
    reply_keys: dict[str, str],
    routes: dict[str, Target],
    settings: WorkerSettings,
    dead_stream: str,
) -> list[Routed]:
    """XADD of every reply entry (`Outcome.reply_entries`: a packing client's claim-checks and
    errors in one) and dead letter, EXPIRE of every reply stream written.

    `reply_keys` maps client ids to their reply streams, `routes` every key to its connection.
    A client's replies are added in one MULTI ... EXEC when there are several: its reader,
    blocked on its stream, wakes once with all of them instead of after the first (Redis serves
    blocked readers between a pipeline's commands, but only after a transaction's EXEC). A
    closed loop's next calls then go out together, which shortens the round trip a worker
    waits for (`anticipation`), and the client reads a batch's replies in one read.
    """
    by_client: dict[str, list[dict[str, Any]]] = {}
    for client_id, fields in outcome.reply_entries():
        by_client.setdefault(client_id, []).append(fields)
    commands: list[Routed] = []
    for client_id, replies in by_client.items():
        key = reply_keys[client_id]
        target = routes[key]
        adds = [(target, ("XADD", key, "*", *_flat(fields))) for fields in replies]
        if len(adds) > 1:
            adds = [(target, ("MULTI",)), *adds, (target, ("EXEC",))]
        commands.extend(adds)
    ttl_s = settings.reply_ttl_s
    commands.extend((routes[key], ("EXPIRE", key, ttl_s)) for key in set(reply_keys.values()))
    if outcome.dead:
        most = settings.max_dead_letters  # an archive for operators: capped, unlike requests
        cap = ("MAXLEN", "~", most) if most else ()
        for entry, reason in outcome.dead:
            dead: dict[Any, Any] = {**entry.fields, b"lmq.reason": reason.encode(),
                                    b"lmq.entry_id": entry.entry_id.encode()}  # fmt: skip
            commands.append((routes[dead_stream], ("XADD", dead_stream, *cap, "*", *_flat(dead))))
    return commands


def execute_routed(thread: WriterThread, commands: Sequence[Routed]) -> list[Any]:
    """Run `commands`, one pipeline per connection, all sent before any is read; the
    answers in the order of `commands` (error replies as `ResponseError`s).

    Raises:
        Redirected: a node answered MOVED or ASK.
        redis.exceptions.ConnectionError, TimeoutError: a connection failed.
    """
    groups: dict[int, tuple[Target, list[int]]] = {}
    for index, (target, _) in enumerate(commands):
        groups.setdefault(id(target), (target, []))[1].append(index)
    sockets = []
    for target, indexes in groups.values():
        sock = thread.socket(target)
        sock.send([commands[i][1] for i in indexes])
        sockets.append((sock, indexes))
    stage_trace.mark("writer_sent")
    results: list[Any] = [None] * len(commands)
    for sock, indexes in sockets:
        for index, result in zip(indexes, sock.receive(len(indexes)), strict=True):
            results[index] = result
    for result in results:
        if isinstance(result, Exception) and str(result).startswith(("MOVED ", "ASK ")):
            raise Redirected(str(result))
    return results


def put_routed(
    thread: WriterThread, puts: Sequence[tuple[str, Any]], routes: dict[str, Target], ttl_s: int
) -> set[str]:
    """SET cache entries on their instance or nodes; the keys stored (none if it failed)."""
    try:
        results = execute_routed(thread, routed_sets(puts, routes, ttl_s))
    except Exception as exc:  # the replies go inline: the cache is an optimisation
        logger.warning("shared cache write of %d entries failed: %s", len(puts), exc)
        return set()
    stored = {key for (key, _), result in zip(puts, results, strict=True) if result == b"OK"}
    if len(stored) < len(puts):
        failed = next(r for r in results if r != b"OK")
        logger.warning("shared cache refused %d of %d entries: %s",
                       len(puts) - len(stored), len(puts), failed)  # fmt: skip
    return stored


def routed_sets(
    puts: Sequence[tuple[str, Any]], routes: dict[str, Target], ttl_s: int
) -> list[Routed]:
    """The SETs of cache entries, each to its connection."""
    commands = SharedCache.set_commands(puts, ttl_s)
    return [(routes[key], command) for (key, _), command in zip(puts, commands, strict=True)]


def _flat(fields: dict[Any, Any]) -> list[Any]:
    """A stream entry's fields as XADD takes them: name, value, name, value, ... (deferred
    payloads made into bytes here, on the writer's thread)."""
    return [part for name, value in fields.items() for part in (name, payload_bytes(value))]
