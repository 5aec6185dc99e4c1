"""The whole Redis key layout, in one place.

Every key starts with a prefix (default ``lmq``). Keys a tenant owns carry the tenant as their
second part, so that ACL rules (``~lmq:<tenant>:*``, see `KeyPatterns`) isolate tenants; the
single-tenant default is ``default``. Keys that describe a model served to everyone (its
registry entry, tokenizer, vocabulary, live workers) carry no tenant.

    lmq:models                                    set of published model names
    lmq:model:<model>:info                        msgpack map: revision, vocab size, context, ...
    lmq:model:<model>:tokenizer                   the tokenizer's JSON (tokenizers library)
    lmq:model:<model>:vocab                       msgpack list of every token's bytes
    lmq:model:<model>:workers                     zset: worker name -> last heartbeat (ms)
    lmq:tenants                                   hash: tenant -> JSON config (operator writes)
    lmq:<tenant>:model:{<model>}:requests         request stream (consumer group "workers")
    lmq:<tenant>:model:{<model>}:quota            hash of the tenant's limits (workers mirror)
    lmq:<tenant>:model:{<model>}:rate             token-rate bucket (the admission script)
    lmq:<tenant>:model:{<model>}:dead             dead-letter stream (workers only)
    lmq:<tenant>:client:{<client>}:replies        one reply stream per client (expires)
    lmq:<ns>:cache:<model>:<rev>:<kind>:<digest>  one cached result vector; ns is the tenant
                                                  or a shared ``pool.<name>`` it opted into

``{...}`` is a Redis Cluster hash tag: every tenant's request stream of one model (and its
quota, rate and dead-letter keys) hash to that model's slot, so one XREADGROUP reads all of
them and the admission script touches one slot; a client's reply stream is one slot of its own.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from .errors import InvalidName

__all__ = [
    "KeySpace",
    "KeyPatterns",
    "WORKER_GROUP",
    "validate_name",
    "validate_client_id",
    "token_digest",
]

#: The consumer group every worker of a model joins on its request stream.
WORKER_GROUP = "workers"

_NAME = re.compile(r"^[A-Za-z0-9._/@+=-]{1,200}$")
_CLIENT_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def validate_name(kind: str, name: str) -> str:
    """Return `name` if it is safe inside a key, else raise `InvalidName` naming `kind`."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidName(f"invalid {kind} name {name!r}: use 1-200 of A-Z a-z 0-9 . _ / @ + = -")
    return name


def validate_client_id(client_id: str) -> str:
    """Return `client_id` if it may name a reply stream, else raise `InvalidName`.

    Stricter than model names: it comes from the wire, and a worker writes to the key it names.
    """
    if not isinstance(client_id, str) or not _CLIENT_ID.match(client_id):
        raise InvalidName(f"invalid client id {client_id!r}: use 1-64 of A-Z a-z 0-9 _ -")
    return client_id


def token_digest(token_bytes: bytes) -> str:
    """A 160-bit digest of a prompt's little-endian token bytes: the exact token tuple, short."""
    return hashlib.blake2b(token_bytes, digest_size=20).hexdigest()


@dataclass(frozen=True)
class KeySpace:
    """Builds every key name from a prefix, a tenant and its cache namespace.

    `cache_namespace` is the first part of cached vectors' keys: empty means the tenant's own.
    """

    prefix: str = "lmq"
    tenant: str = "default"
    cache_namespace: str = ""

    def __post_init__(self) -> None:
        validate_name("prefix", self.prefix)
        validate_name("tenant", self.tenant)
        if self.cache_namespace:
            validate_name("cache namespace", self.cache_namespace)

    def for_tenant(self, tenant: str, cache_namespace: str = "") -> KeySpace:
        """The same layout for another tenant (a worker serves them all)."""
        return KeySpace(self.prefix, tenant, cache_namespace)

    # -- model registry (global) -------------------------------------------------------------
    def models(self) -> str:
        """The set of model names any worker ever published."""
        return f"{self.prefix}:models"

    def model_info(self, model: str) -> str:
        """The model's published metadata."""
        return f"{self.prefix}:model:{model}:info"

    def model_tokenizer(self, model: str) -> str:
        """The model's tokenizer as tokenizers-library JSON."""
        return f"{self.prefix}:model:{model}:tokenizer"

    def model_vocab(self, model: str) -> str:
        """The model's byte vocabulary."""
        return f"{self.prefix}:model:{model}:vocab"

    def model_workers(self, model: str) -> str:
        """The zset of live workers of the model, scored by last heartbeat (ms)."""
        return f"{self.prefix}:model:{model}:workers"

    def tenants(self) -> str:
        """The hash of tenant name -> JSON config, written by the operator (``lmq tenant``)."""
        return f"{self.prefix}:tenants"

    # -- per tenant ----------------------------------------------------------------------------
    def requests(self, model: str) -> str:
        """The tenant's request stream of the model."""
        return f"{self.prefix}:{self.tenant}:model:{{{model}}}:requests"

    def dead_letters(self, model: str) -> str:
        """The tenant's dead-letter stream of the model."""
        return f"{self.prefix}:{self.tenant}:model:{{{model}}}:dead"

    def replies(self, client_id: str) -> str:
        """The reply stream of one client of the tenant."""
        return f"{self.prefix}:{self.tenant}:client:{{{client_id}}}:replies"

    def cache_entry(self, model: str, revision: str, kind: str, token_bytes: bytes) -> str:
        """The shared-cache key of one result: model, revision, result kind, exact tokens."""
        digest = token_digest(token_bytes)
        namespace = self.cache_namespace or self.tenant
        return f"{self.prefix}:{namespace}:cache:{model}:{revision}:{kind}:{digest}"

    def quota(self, model: str) -> str:
        """The tenant's limits for the model (hash), read by its admission script."""
        return f"{self.prefix}:{self.tenant}:model:{{{model}}}:quota"

    def rate(self, model: str) -> str:
        """The tenant's token-rate bucket for the model, written by its admission script."""
        return f"{self.prefix}:{self.tenant}:model:{{{model}}}:rate"


@dataclass(frozen=True)
class KeyPatterns:
    """The key layout as ACL glob patterns: one tenant's keys, or every tenant's (``"*"``).

    Names never hold a glob character (`validate_name`), so a tenant's patterns begin with
    ``<prefix>:<tenant>:`` and match no other tenant's keys.
    """

    prefix: str = "lmq"
    tenant: str = "*"

    def __post_init__(self) -> None:
        validate_name("prefix", self.prefix)
        if self.tenant != "*":
            validate_name("tenant", self.tenant)

    def registry(self) -> list[str]:
        """What clients read to use a model: the model set, info, tokenizer, vocabulary."""
        model = f"{self.prefix}:model:*"
        return [f"{self.prefix}:models", f"{model}:info", f"{model}:tokenizer", f"{model}:vocab"]

    def registry_all(self) -> list[str]:
        """Every registry key, the workers' live sets included (what workers write)."""
        return [f"{self.prefix}:models", f"{self.prefix}:model:*"]

    def tenants(self) -> str:
        """The tenants hash."""
        return f"{self.prefix}:tenants"

    def requests(self) -> str:
        """Request streams of every model."""
        return f"{self.prefix}:{self.tenant}:model:*:requests"

    def quota(self) -> str:
        """Quota hashes of every model."""
        return f"{self.prefix}:{self.tenant}:model:*:quota"

    def rate(self) -> str:
        """Rate buckets of every model."""
        return f"{self.prefix}:{self.tenant}:model:*:rate"

    def dead_letters(self) -> str:
        """Dead-letter streams of every model."""
        return f"{self.prefix}:{self.tenant}:model:*:dead"

    def replies(self) -> str:
        """Reply streams of every client."""
        return f"{self.prefix}:{self.tenant}:client:*:replies"

    def cache(self, namespace: str | None = None) -> str:
        """Cached vectors of one cache namespace (default: the tenant's own; ``*``: all)."""
        return f"{self.prefix}:{namespace or self.tenant}:cache:*"
