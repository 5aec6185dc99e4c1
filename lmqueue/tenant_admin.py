"""`TenantAdmin`: what ``lmq tenant`` does, on a Redis connection holding admin credentials.

Each tenant is an ACL user with the rules of `shared.tenants.tenant_acl_rules` and a JSON record
in the ``lmq:tenants`` hash; its limits are mirrored into its ``:quota`` hash of every published
model (workers keep mirroring them for models published later). Passwords are made here with
`secrets`, sent to Redis only as SHA-256 hashes, and shown once, inside the URL to give the
tenant. The admission script is loaded on every change, so tenants (who may only EVALSHA)
find it. Where Redis has an ACL file, changes are saved to it (``ACL SAVE``), else they last
until Redis restarts: say so.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from redis.cluster import REPLICA, ClusterNode, RedisCluster
from redis.exceptions import RedisError, ResponseError

from lmqueue.shared.admission_script import ADMISSION_LUA
from lmqueue.shared.errors import SettingsError
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.redis_errors import translate
from lmqueue.shared.registry import ModelInfo
from lmqueue.shared.settings import mask_url
from lmqueue.shared.tenants import (
    WORKER_USER,
    TenantConfig,
    password_hash,
    quota_fields,
    tenant_acl_rules,
    validate_tenant,
    worker_acl_rules,
)

__all__ = ["TenantAdmin", "TenantRow", "user_url"]

logger = logging.getLogger(__name__)


def user_url(admin_url: str, user: str, password: str) -> str:
    """The admin's URL with its credentials replaced by `user`'s, database 0."""
    parts = urlsplit(admin_url)
    host = parts.hostname or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    port = f":{parts.port}" if parts.port else ""
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}{port}"
    return urlunsplit((parts.scheme, netloc, "/0", parts.query, ""))


@dataclass(frozen=True)
class TenantRow:
    """One tenant as `TenantAdmin.tenants` reports it."""

    config: TenantConfig
    #: Whether Redis has the tenant's ACL user (a record without one cannot connect).
    has_user: bool


class TenantAdmin:
    """Creates, changes and removes tenants and the workers' user (sync redis-py client).

    `caches` are the deployment's other instances (a separate cache), each an admin client
    and its URL: every user is made on each of them too, with the same password, so a
    tenant's one URL works everywhere. A change reaches every instance or none: access to
    each is checked first, and a user made on some before one refused is deleted again.
    """

    def __init__(
        self,
        redis: Any,
        url: str,
        prefix: str = "lmq",
        cache_redis: Any | None = None,
        cache_url: str | None = None,
        caches: Sequence[tuple[Any, str]] = (),
    ) -> None:
        self.redis = redis
        self.url = url
        self.prefix = prefix
        self.keys = KeySpace(prefix)
        self.caches = list(caches)
        if cache_redis is not None:
            self.caches.append((cache_redis, cache_url or ""))

    @property
    def _instances(self) -> list[tuple[Any, str]]:
        return [(self.redis, self.url), *self.caches]

    def check_access(self) -> None:
        """Raise `SettingsError` unless this admin may manage users on every instance.

        Raises:
            SettingsError: naming the instance (password masked) and what it answered.
        """
        for client, url in self._instances:
            try:
                client.execute_command("ACL", "USERS", **_every_node(client))
            except (RedisError, OSError) as exc:
                raise SettingsError(
                    f"nothing changed: cannot manage users at {mask_url(url)} "
                    f"({translate(exc, 'ACL USERS', url).message})",
                    remedy="give that instance's admin URL with --cache-url, or start it",
                ) from exc

    def _acl(self, *args: Any, undo: Sequence[Any] = ()) -> None:
        """Run one ACL command on every instance (on a Redis Cluster on every node: each node
        keeps its own users); where one fails, run `undo` where it succeeded, and raise."""
        done: list[Any] = []
        for client, url in self._instances:
            try:
                client.execute_command("ACL", *args, **_every_node(client))
            except (RedisError, OSError) as exc:
                for earlier in done if undo else ():
                    earlier.execute_command("ACL", *undo, **_every_node(earlier))
                outcome = (
                    "nothing changed" if undo or not done
                    else f"changed on {len(done)} of {len(self._instances)} instances"
                )  # fmt: skip
                raise SettingsError(
                    f"{outcome}: {mask_url(url)} refused ACL {args[0]} "
                    f"({translate(exc, 'ACL', url).message})"
                ) from exc
            done.append(client)

    # -- tenants ---------------------------------------------------------------------------------
    def add(self, config: TenantConfig, password: str | None = None) -> str:
        """Create tenant `config.name`; returns the URL (with a new password) to give it.

        Raises:
            SettingsError: if the tenant or its ACL user exists already, or is the admin's own.
        """
        self._not_myself(config.name)
        if self.redis.hexists(self.keys.tenants(), config.name) or self._user_exists(config.name):
            raise SettingsError(
                f"tenant {config.name!r} exists",
                remedy=f"change it with `lmq tenant set {config.name} ...`, or remove it first",
            )
        password = password or secrets.token_urlsafe(24)
        rules = tenant_acl_rules(config, self.prefix)
        self.check_access()
        self._acl("SETUSER", config.name, "reset", "on", password_hash(password), *rules,
                  undo=("DELUSER", config.name))  # fmt: skip
        self._store(config)
        return user_url(self.url, config.name, password)

    def set(self, name: str, new_password: bool = False, **changes: Any) -> str | None:
        """Change a tenant's settings (and rules); returns a new URL if the password changed.

        Raises:
            SettingsError: if there is no such tenant.
        """
        self._not_myself(name)
        config = replace(self.get(name), **changes)
        rules = tenant_acl_rules(config, self.prefix)
        password = secrets.token_urlsafe(24) if new_password else None
        credentials = ["resetpass", password_hash(password)] if password else []
        self.check_access()
        self._acl("SETUSER", name, *credentials, *rules)
        self._store(config)
        return user_url(self.url, name, password) if password else None

    def remove(self, name: str) -> None:
        """Delete the tenant's user (its connections close), record and quota hashes.

        Its request and reply streams stay. Within a tenant refresh, workers stop reading its
        request stream: requests they had read are answered, the rest stay in the stream
        (answered if the tenant is added again).
        """
        self._not_myself(validate_tenant(name))
        self.check_access()
        self._acl("DELUSER", name)
        self.redis.hdel(self.keys.tenants(), name)
        tenant_keys = KeySpace(self.prefix, name)
        quotas = [key for model in self._models() for key in self._quota_keys(tenant_keys, model)]
        if quotas:
            self.redis.delete(*quotas)
        self._save_acl()

    def get(self, name: str) -> TenantConfig:
        """The stored configuration of tenant `name`.

        Raises:
            SettingsError: if there is no such tenant.
        """
        raw = self.redis.hget(self.keys.tenants(), validate_tenant(name))
        if raw is None:
            raise SettingsError(f"no tenant {name!r}", remedy="`lmq tenant list` shows them")
        return TenantConfig.from_json(name, raw)

    def tenants(self) -> list[TenantRow]:
        """Every tenant with a record, by name."""
        records = self.redis.hgetall(self.keys.tenants())
        users = {_text(u) for u in self.redis.execute_command("ACL", "USERS")}
        rows = []
        for raw_name, raw in sorted(records.items()):
            name = _text(raw_name)
            rows.append(TenantRow(TenantConfig.from_json(name, raw), name in users))
        return rows

    # -- workers ---------------------------------------------------------------------------------
    def worker_user(self, name: str = WORKER_USER, password: str | None = None) -> str:
        """Create or reset the workers' ACL user; returns its URL (new password)."""
        self._not_myself(name)
        password = password or secrets.token_urlsafe(24)
        rules = worker_acl_rules(self.prefix)
        self.check_access()
        self._acl("SETUSER", name, "reset", "on", password_hash(password), *rules)
        self._save_acl()
        return user_url(self.url, name, password)

    def reapply_rules(self, worker: str = WORKER_USER) -> list[str]:
        """Give every tenant's user and the workers' user the rules this version generates,
        keeping their passwords; returns the users changed.

        Rules change between versions (private adapters' records moved out of the hash every
        tenant could read): until they are applied again, a user keeps what it was granted.
        """
        self.check_access()
        changed = []
        for row in self.tenants():
            if row.has_user:
                self._acl("SETUSER", row.config.name, *tenant_acl_rules(row.config, self.prefix))
                changed.append(row.config.name)
        if self._user_exists(worker):
            self._acl("SETUSER", worker, *worker_acl_rules(self.prefix))
            changed.append(worker)
        self._save_acl()
        return changed

    # -- helpers ---------------------------------------------------------------------------------
    def _store(self, config: TenantConfig) -> None:
        """Write the record, mirror its quotas, load the admission script, save the ACLs."""
        self.redis.hset(self.keys.tenants(), config.name, config.to_json())
        tenant_keys = KeySpace(self.prefix, config.name)
        fields = quota_fields(config)
        for model in self._models():
            for key in self._quota_keys(tenant_keys, model):
                self.redis.hset(key, mapping=fields)
        self.redis.script_load(ADMISSION_LUA)
        self._save_acl()

    def _quota_keys(self, tenant_keys: KeySpace, model: str) -> list[str]:
        """The tenant's quota hash of `model` and its partitions' copies, as published."""
        raw = self.redis.get(self.keys.model_info(model))
        partitions = ModelInfo.from_bytes(raw).partitions if raw else 1
        return tenant_keys.quota_copies(model, partitions)

    def _models(self) -> list[str]:
        return sorted(_text(m) for m in self.redis.smembers(self.keys.models()))

    def _user_exists(self, name: str) -> bool:
        return name in {_text(u) for u in self.redis.execute_command("ACL", "USERS")}

    def _not_myself(self, name: str) -> None:
        if _text(self.redis.execute_command("ACL", "WHOAMI")) == name:
            raise SettingsError(f"{name!r} is the user this command is connected as; refusing")

    def acl_file(self) -> str | None:
        """The ACL file Redis saves users to, or None (users last until Redis restarts)."""
        path = _text(self.redis.config_get("aclfile").get("aclfile") or "")
        return path or None

    def published_cache_addresses(self) -> list[str]:
        """The separate cache instances the workers publish (no credentials), sorted."""
        addresses = set()
        for model in self._models():
            raw = self.redis.get(self.keys.model_info(model))
            if raw and ModelInfo.from_bytes(raw).cache_address:
                addresses.add(ModelInfo.from_bytes(raw).cache_address)
        return sorted(addresses)

    def _save_acl(self) -> None:
        for client, _ in self._instances:
            try:  # one round on every node: ACL SAVE refuses where no aclfile is configured
                client.execute_command("ACL", "SAVE", **_every_node(client))
            except ResponseError as exc:
                logger.warning("Redis has no aclfile (%s): users last only until it restarts", exc)


def _every_node(client: Any) -> dict[str, Any]:
    """redis-py's routing argument sending a command to every node of a cluster client.

    Every node ``CLUSTER NODES`` lists, replicas included: redis-py knows only the nodes of
    ``CLUSTER SLOTS``, which leaves out replicas that hold no data yet (a new cluster's), and
    a replica without the users locks every tenant out once a failover promotes it (found by
    ``lmq bench soak --cluster``).
    """
    if not isinstance(client, RedisCluster):
        return {}
    nodes = {node.name: node for node in client.get_nodes()}
    for address, info in client.cluster_nodes().items():
        flags = str(info.get("flags", ""))
        if address not in nodes and "fail" not in flags and "noaddr" not in flags:
            host, port = address.rsplit(":", 1)
            nodes[address] = ClusterNode(host, int(port), REPLICA)
    return {"target_nodes": list(nodes.values())}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
