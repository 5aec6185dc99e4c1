"""Tenants: names, their configuration record, and the Redis ACL rules that isolate them.

A tenant is a Redis ACL user of the same name; its clients connect as that user, so what a
tenant may touch is decided by Redis itself. `tenant_acl_rules` builds the exact
``ACL SETUSER`` arguments: commands granted by name, each in a selector with exactly the keys
it may touch (a selector grants a command only on its own keys), no channels, nothing that
ignores key patterns (KEYS, SCAN, FLUSH*, RANDOMKEY) and no administration (CONFIG, ACL, DEBUG,
SCRIPT, CLIENT). `worker_acl_rules` does the same for the one user all workers share. The
operator's own user is not managed here; docs/SECURITY.md explains the whole trust model.

A tenant's configuration is one JSON value in the ``lmq:tenants`` hash (operator writes,
workers read); its limits and cache namespace are mirrored into the tenant's ``:quota`` hash
of each model, which the tenant's admission script and clients read.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import InvalidName, SettingsError
from .keys import KeyPatterns, KeySpace

__all__ = [
    "DEFAULT_TENANT",
    "WORKER_USER",
    "TenantConfig",
    "validate_tenant",
    "validate_cache_namespace",
    "password_hash",
    "tenant_acl_rules",
    "worker_acl_rules",
    "quota_fields",
    "read_cache_namespace",
]

#: The tenant of clients that connect without an ACL user name (single-user deployments).
DEFAULT_TENANT = "default"
#: The ACL user every worker runs as.
WORKER_USER = "lmq-worker"
#: Words of the key layout; a tenant of that name would blur ``<prefix>:<tenant>:`` patterns.
_RESERVED = frozenset({"model", "models", "tenants", "cache", "client", WORKER_USER})
_TENANT = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
#: A namespace tenants opt into sharing: ``pool.<name>`` (a tenant name never holds a dot).
_POOL = re.compile(r"^pool\.[a-z0-9][a-z0-9_-]{0,62}$")

#: Connection housekeeping every user needs: health checks, RESP3 handshakes and the
#: server's run id (clients watch it to notice a restarted Redis). redis-py's CLIENT SETINFO
#: (Redis 7.2+) is refused and redis-py carries on without it.
#: Every user: liveness, protocol, the server's run id (restart detection), whether it is a
#: cluster node (`shared.connections` asks once at connect) and, on a cluster, what redis-py's
#: cluster client reads to route commands (the slot map, the command table).
_CONNECTION = [
    "+ping", "+hello", "+info|server", "+info|cluster", "+cluster|slots", "+cluster|shards",
    "+command",
]  # fmt: skip
#: What `producer.Experiments` sends on the tenant's own experiment keys.
EXPERIMENT_COMMANDS = ["+hsetnx", "+hset", "+hgetall", "+zadd", "+zrange", "+xadd", "+lrange"]


def validate_tenant(name: str) -> str:
    """Return `name` if it may name a tenant (and its ACL user), else raise `InvalidName`."""
    if not isinstance(name, str) or not _TENANT.match(name):
        raise InvalidName(
            f"invalid tenant name {name!r}: 1-63 of a-z 0-9 _ -, starting with a letter or digit"
        )
    if name in _RESERVED:
        raise InvalidName(f"tenant name {name!r} is reserved")
    return name


def validate_cache_namespace(namespace: str) -> str:
    """Return `namespace` if it is a shared ``pool.<name>``, else raise `InvalidName`.

    A tenant's cache namespace is its own name (private) or a pool; never another tenant's.
    """
    if isinstance(namespace, str) and _POOL.match(namespace):
        return namespace
    raise InvalidName(
        f"invalid cache namespace {namespace!r}: a tenant's own name or pool.<name> (a-z 0-9 _ -)"
    )


def password_hash(password: str) -> str:
    """The ``#<sha256>`` form of a password: Redis stores it, the plain text never travels."""
    return "#" + hashlib.sha256(password.encode()).hexdigest()


@dataclass(frozen=True)
class TenantConfig:
    """One tenant's configuration, stored as JSON in the ``lmq:tenants`` hash.

    Attributes:
        weight: share of every worker relative to other backlogged tenants (fair share).
        max_inflight: requests queued or running at once per model (0: unlimited).
        max_tokens_per_s: prompt tokens admitted per second per model (0: unlimited).
        cache_namespace: whose cached vectors the tenant's requests read and write: its
            own name (default, private) or a shared ``pool.<name>``.
    """

    name: str
    weight: float = 1.0
    max_inflight: int = 0
    max_tokens_per_s: float = 0.0
    cache_namespace: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        validate_tenant(self.name)
        if not self.cache_namespace:
            object.__setattr__(self, "cache_namespace", self.name)
        elif self.cache_namespace != self.name:
            validate_cache_namespace(self.cache_namespace)
        _check_number("weight", self.weight, positive=True)
        _check_number("max_inflight", self.max_inflight, integer=True)
        _check_number("max_tokens_per_s", self.max_tokens_per_s)

    def to_json(self) -> str:
        """The JSON value stored under the tenant's name (the name itself is the hash field)."""
        record = asdict(self)
        del record["name"], record["extra"]
        return json.dumps({**self.extra, **record}, sort_keys=True)

    @classmethod
    def from_json(cls, name: str, raw: str | bytes) -> TenantConfig:
        """Parse a stored record; fields this version does not know are kept, not dropped.

        Raises:
            SettingsError: if the record is not a JSON object of valid values.
        """
        try:
            record = json.loads(raw)
        except ValueError as exc:
            raise SettingsError(f"tenant {name!r}: config is not JSON: {exc}") from None
        if not isinstance(record, dict):
            raise SettingsError(f"tenant {name!r}: config is not a JSON object")
        known = {"weight", "max_inflight", "max_tokens_per_s", "cache_namespace"}
        extra = {k: v for k, v in record.items() if k not in known}
        values = {k: v for k, v in record.items() if k in known}
        return cls(name, extra=extra, **values)

    @property
    def shares_cache(self) -> bool:
        """Whether the tenant reads and writes a shared cache namespace."""
        return self.cache_namespace != self.name


def _check_number(name: str, value: Any, positive: bool = False, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        kind = "integer" if integer else "number"
        raise SettingsError(f"{name} must be a finite {kind}: {value!r}")
    if value < 0 or (positive and value <= 0):
        raise SettingsError(f"{name} must be {'positive' if positive else '>= 0'}: {value!r}")


def quota_fields(config: TenantConfig) -> dict[str, str]:
    """The tenant's ``:quota`` hash (strings, as the admission script reads them).

    It also tells the tenant's clients their cache namespace: they may read the quota hash,
    not the operator's ``lmq:tenants``.
    """
    return {
        "max_inflight": str(config.max_inflight),
        "max_tokens_per_s": repr(float(config.max_tokens_per_s)),
        "cache_namespace": config.cache_namespace,
    }


async def read_cache_namespace(redis: Any, keys: KeySpace, model: str) -> str:
    """The cache namespace the operator chose for `keys.tenant` ('' if none is mirrored)."""
    (raw,) = await redis.hmget(keys.quota(model), "cache_namespace")
    if raw is None:
        return ""
    namespace = raw.decode() if isinstance(raw, bytes) else str(raw)
    return validate_cache_namespace(namespace) if namespace != keys.tenant else ""


def _selector(commands: Sequence[str], keys: Sequence[str]) -> str:
    """One ACL selector: these commands, on exactly these keys (``%R~``/``%W~``/``~``)."""
    return "(" + " ".join([*commands, *keys]) + ")"


def tenant_acl_rules(config: TenantConfig, prefix: str = "lmq") -> list[str]:
    """The rules after ``ACL SETUSER <tenant>`` that grant what its clients need, and no more.

    Passwords are not part of them (see `password_hash`); apply to a user reset beforehand or
    with ``resetkeys resetchannels -@all clearselectors`` first, which these rules start with.

    A client may: read the model registry (public adapters' records among it) and its own
    private adapters' records, never another tenant's; run the admission script (EVALSHA
    only: scripts are loaded by workers and the operator, so a tenant cannot run Lua of its
    own) which reads the tenant's ``:quota``, updates its ``:rate`` and XADDs to its request
    streams; read, trim and delete its reply streams; GET/MGET its cache namespace; submit,
    watch, cancel and read its own experiments (the scheduler's and arq's keys stay out of
    reach).
    """
    own = KeyPatterns(prefix, config.name)
    cache = own.cache(config.cache_namespace)
    return [
        "resetkeys", "resetchannels", "clearselectors", "-@all", *_CONNECTION, "+time",
        _selector(
            ["+get", "+smembers", "+exists", "+hgetall"], [f"%R~{k}" for k in own.registry()]
        ),
        # its own private adapters' records; the model's full hash of records stays out of reach
        _selector(["+hgetall"], [f"%R~{own.private_adapters()}"]),
        _selector(["+evalsha"], [f"~{own.requests()}", f"~{own.rate()}"]),
        _selector(["+xadd", "+xlen"], [f"~{own.requests()}"]),
        _selector(["+hmget"], [f"%R~{own.quota()}", f"~{own.rate()}"]),
        _selector(["+hset", "+pexpire"], [f"~{own.rate()}"]),
        _selector(["+xread", "+xtrim", "+del"], [f"~{own.replies()}"]),
        # its own namespace too: a private adapter's rows never go to a shared pool
        _selector(["+get", "+mget"], sorted({f"%R~{cache}", f"%R~{own.cache()}"})),
        _selector(EXPERIMENT_COMMANDS, [f"~{own.experiments()}"]),
    ]  # fmt: skip


def worker_acl_rules(prefix: str = "lmq") -> list[str]:
    """The rules after ``ACL SETUSER lmq-worker``: serve every tenant of every model.

    Workers read and acknowledge all request streams through the consumer group, write
    replies, dead letters, cached vectors, the registry and their stats hashes, every
    adapter record and tenant's view of them (a worker publishes its own adapters and
    rebuilds the views), mirror quotas, read the tenants hash, and load the scripts tenants
    run (SCRIPT LOAD). They
    cannot read reply streams or rate buckets, nor touch ACLs, configuration or keys outside
    the layout.
    """
    every = KeyPatterns(prefix, "*")
    stream_commands = [
        "+xreadgroup", "+xack", "+xdel", "+xclaim", "+xautoclaim", "+xpending", "+xlen", "+xrange",
        "+xinfo|consumers", "+xinfo|groups", "+xinfo|stream",
        "+xgroup|create", "+xgroup|createconsumer", "+xgroup|delconsumer",
        "+evalsha", "+eval",
    ]  # fmt: skip
    registry_commands = [  # publishing is one script; the stats hash is for `lmq status`
        "+get", "+set", "+exists", "+sadd", "+smembers", "+evalsha", "+eval",
        "+zadd", "+zrem", "+zrange", "+zrangebyscore", "+zremrangebyscore",
        "+hset", "+hgetall", "+expire", "+del",
    ]  # fmt: skip
    adapter_commands = [  # the records and every tenant's view: `shared.adapter_views`
        "+hget", "+hgetall", "+hlen", "+hset", "+hdel", "+del", "+evalsha",
    ]  # fmt: skip
    return [
        "resetkeys", "resetchannels", "clearselectors", "-@all", *_CONNECTION,
        "+script|load", "+script|exists", "+multi", "+exec", "+discard", "+time",
        _selector(registry_commands, [f"~{k}" for k in every.registry_all()]),
        _selector(adapter_commands, [f"~{k}" for k in every.adapter_records()]),
        _selector(["+hget", "+hgetall", "+hkeys"], [f"%R~{every.tenants()}"]),
        _selector(stream_commands, [f"~{every.requests()}"]),
        _selector(["+hset", "+hmget", "+hgetall", "+del"], [f"~{every.quota()}"]),
        _selector(["+xadd", "+expire"], [f"%W~{every.replies()}"]),
        _selector(["+xadd"], [f"%W~{every.dead_letters()}"]),
        _selector(["+get", "+mget", "+set"], [f"~{every.cache('*')}"]),
    ]  # fmt: skip
