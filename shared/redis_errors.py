"""The one place where redis-py's exceptions become lmqueue's.

Callers of lmqueue never see a redis-py exception: every path that talks to Redis on a
caller's behalf (connecting a client, submitting, reading replies, a worker's start-up) goes
through `redis_boundary`, which turns what Redis or the network said into the error tree of
`shared.errors`:

    connection refused, reset, timed out, LOADING, READONLY, ...  -> Unavailable
    OOM command not allowed, BUSY (a script runs too long)         -> Busy
    NOPERM (an ACL rule)                                           -> Forbidden
    WRONGPASS, NOAUTH (wrong user or password)                     -> AuthenticationFailed
    any other refusal                                              -> Unavailable

Loops that retry while Redis is away (the submitter, the reply reader, the worker) catch
`REDIS_DOWN`, the single definition of "Redis cannot be reached right now"; a wrong user or
password (`REDIS_AUTH`, a subclass of redis-py's ConnectionError) is never retried. Every
message is passed through `mask_secrets`: no password reaches a caller.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    ClusterError,
    NoPermissionError,
    RedisError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
    WatchError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .errors import AuthenticationFailed, Busy, Forbidden, LMQueueError, Unavailable
from .settings import mask_secrets, mask_url

__all__ = [
    "REDIS_AUTH",
    "REDIS_DOWN",
    "REDIS_TROUBLE",
    "redis_boundary",
    "reply_error",
    "translate",
]

#: A wrong user or password: retrying cannot help (redis-py raises it as a ConnectionError).
REDIS_AUTH: tuple[type[BaseException], ...] = (AuthenticationError,)

#: What "Redis cannot be reached right now" looks like: retry on a new connection, later.
#: (redis-py's BusyLoadingError, a server still loading its data, is a ConnectionError.) On a
#: Redis Cluster also: CLUSTERDOWN/MASTERDOWN while a failover runs, TRYAGAIN during a
#: resharding, a slot no node serves yet, and redis-py giving up on redirections (ClusterError).
REDIS_DOWN: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    ConnectionError,
    OSError,
    ClusterError,
    TryAgainError,
    SlotNotCoveredError,
)

#: Down, or refusing a command for now (NOGROUP after a restart emptied the server): what a
#: worker's background loops log and outlive. WatchError too: redis-py raises it for a
#: connection lost while a key is watched (arq's enqueue and claim watch theirs), and at EXEC
#: for a watched key that changed, which a retry settles as well.
REDIS_TROUBLE: tuple[type[BaseException], ...] = (*REDIS_DOWN, ResponseError, WatchError)

#: Everything `redis_boundary` translates.
_TRANSLATED: tuple[type[BaseException], ...] = (RedisError, *REDIS_DOWN)

#: Refusals that mean "this server cannot take writes or answer right now", not "never".
_TRANSIENT_REFUSALS = ("LOADING", "READONLY", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN")


def reply_error(text: str) -> RedisError:
    """The redis-py exception for an error reply `text` read by lmqueue's own RESP readers,
    as redis-py's parser makes it where it matters: a server still loading its data after a
    restart (LOADING) is down for now (`REDIS_DOWN`), not a refusal of the command."""
    if text.startswith("LOADING"):
        return BusyLoadingError(text)
    return ResponseError(text)


def translate(error: BaseException, what: str, url: str | None = None) -> LMQueueError:
    """The lmqueue error for a redis-py or socket `error` raised while doing `what` (on the
    Redis at `url`, named with its password masked where given)."""
    if isinstance(error, LMQueueError):
        return error
    what, text = mask_secrets(what), mask_secrets(str(error))
    if isinstance(error, AuthenticationError) or text.startswith(("WRONGPASS", "NOAUTH")):
        where = f" for {mask_url(url)}" if url else ""
        return AuthenticationFailed(
            f"{what}: wrong user or password{where} ({text})", url=mask_url(url or "")
        )
    if isinstance(error, NoPermissionError) or text.startswith("NOPERM"):
        return Forbidden(f"{what}: Redis refused this user: {text}")
    if isinstance(error, ResponseError) and text.startswith(("OOM", "BUSY ")):
        return Busy(f"{what}: Redis is overloaded: {text}")
    if isinstance(error, ResponseError) and not text.startswith(_TRANSIENT_REFUSALS):
        return Unavailable(f"{what}: Redis refused: {text}")
    where = f" at {mask_url(url)}" if url else ""
    return Unavailable(f"{what}: Redis{where} cannot be reached ({type(error).__name__}: {text})")


@contextlib.contextmanager
def redis_boundary(what: str, url: str | None = None) -> Iterator[None]:
    """Re-raise any redis-py or socket error inside the block as `translate` says.

    Works around ``await`` too: ``with redis_boundary("connecting"): await ...``.
    """
    try:
        yield
    except LMQueueError:
        raise
    except _TRANSLATED as exc:
        raise translate(exc, what, url) from exc
