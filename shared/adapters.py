"""LoRA adapters of a model: their registry records, names, revisions and who may use them.

An adapter is served by name. Its record in the model's registry entry
(``lmq:model:{<model>}:adapters``, a hash: name -> msgpack record) says where its PEFT
directory is, a digest of its files (`revision`) and whether it is public or private to one
tenant. Workers load every record of their model (at start and then every few seconds), so
``lmq adapter add`` reaches running workers without a restart; clients read the records they
may use to check names and to build cache keys: copies of the public ones and of their
tenant's private ones (`shared.adapter_views`). No tenant can read another's private
records, not even their names: a private adapter's name and directory say what its tenant
works on.

Why a revision: a name may be given new weights (``lmq adapter add`` again with another
directory). Cached rows are keyed on the adapter's revision, never on its name alone, so rows
of the old weights are never served for the new ones; a worker whose copy of the directory
does not match the record's revision refuses to load it.

Names are untrusted tenant input on the wire: 1-64 of ``A-Z a-z 0-9 . _ -``, checked by the
client, by the wire decoder and by the worker, which also checks the record's tenant itself.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from .adapter_views import MOVE_LUA, REBUILD_LUA, rebuild_arguments
from .errors import Busy, Forbidden, InvalidName, MalformedMessage, UnknownAdapter
from .keys import KeySpace

__all__ = [
    "ADAPTER_NAME",
    "AdapterRecord",
    "AdapterRegistry",
    "adapter_revision",
    "check_adapter",
    "parse_adapter_spec",
    "validate_adapter_name",
    "visible_adapters",
]

#: What an adapter name may be: short, and safe inside a cache key.
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
#: Files of a PEFT adapter directory whose bytes decide its results.
_WEIGHT_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
_MAX_RECORD_BYTES = 16 << 10


def validate_adapter_name(name: Any) -> str:
    """Return `name` if it may name an adapter, else raise `InvalidName`."""
    if not isinstance(name, str) or not ADAPTER_NAME.match(name):
        raise InvalidName(f"invalid adapter name {name!r}: use 1-64 of A-Z a-z 0-9 . _ -")
    return name


def parse_adapter_spec(spec: str) -> tuple[str, str]:
    """``NAME=PATH`` (the ``--adapter`` option) as a validated name and a path."""
    name, sep, path = spec.partition("=")
    if not sep or not path:
        raise InvalidName(f"adapter {spec!r}: expected NAME=PATH")
    return validate_adapter_name(name), path


def adapter_revision(path: str | Path) -> str:
    """A digest of the files of the PEFT adapter directory at `path` that decide its results.

    Raises:
        FileNotFoundError: if `path` holds no ``adapter_config.json``.
    """
    directory = Path(path)
    if not (directory / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"{directory} is not a PEFT adapter directory (no adapter_config.json)"
        )
    digest = hashlib.blake2b(digest_size=8)
    for name in _WEIGHT_FILES:
        file = directory / name
        if file.is_file():
            digest.update(name.encode() + b"\0")
            with file.open("rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class AdapterRecord:
    """One adapter as published: name, directory, revision, and its tenant (None: public)."""

    name: str
    path: str
    revision: str
    tenant: str | None = None

    def to_bytes(self) -> bytes:
        """Encode as msgpack (the hash's value; the name is the field)."""
        fields = {"path": self.path, "revision": self.revision, "tenant": self.tenant}
        return msgpack.packb(fields, use_bin_type=True)

    @classmethod
    def from_bytes(cls, name: str, raw: bytes) -> AdapterRecord:
        """Decode and validate a record read from the registry."""
        if not isinstance(raw, bytes) or len(raw) > _MAX_RECORD_BYTES:
            raise MalformedMessage(f"adapter record {name!r} is not bytes within the limit")
        try:
            fields = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_map_len=16)
        except Exception as exc:  # msgpack raises a zoo of types for garbage input
            raise MalformedMessage(f"adapter record {name!r} does not decode: {exc}") from None
        if not isinstance(fields, dict):
            raise MalformedMessage(f"adapter record {name!r} is not a map")
        path, revision, tenant = fields.get("path"), fields.get("revision"), fields.get("tenant")
        if not (isinstance(path, str) and isinstance(revision, str)):
            raise MalformedMessage(f"adapter record {name!r} lacks a path or revision")
        if tenant is not None and not isinstance(tenant, str):
            raise MalformedMessage(f"adapter record {name!r} has a bad tenant")
        return cls(validate_adapter_name(name), path, revision, tenant)

    def cache_tag(self) -> str:
        """What cache keys carry for this adapter: its name and revision."""
        return f"{self.name}@{self.revision}"

    def usable_by(self, tenant: str) -> bool:
        """Whether `tenant` may name this adapter."""
        return self.tenant is None or self.tenant == tenant


def visible_adapters(records: dict[str, AdapterRecord], tenant: str) -> list[str]:
    """The names `tenant` may use, sorted (what errors list: never another tenant's)."""
    return sorted(name for name, record in records.items() if record.usable_by(tenant))


def check_adapter(
    records: dict[str, AdapterRecord], name: str | None, tenant: str
) -> AdapterRecord | None:
    """The record `tenant` asks for by `name` (None: the base model), or a typed refusal.

    Raises:
        InvalidName: `name` cannot be an adapter's.
        UnknownAdapter: no adapter of that name is served; lists those the tenant may use.
        Forbidden: the adapter is private to another tenant.
    """
    if name is None:
        return None
    validate_adapter_name(name)
    record = records.get(name)
    served = visible_adapters(records, tenant)
    if record is None:
        raise UnknownAdapter(
            f"LoRA adapter {name!r} is not served; served: {', '.join(served) or 'none'}",
            adapter=name, served=served,
        )  # fmt: skip
    if not record.usable_by(tenant):
        raise Forbidden(f"adapter {name!r} is private to another tenant", adapter=name)
    return record


class AdapterRegistry:
    """Reads and writes one model's adapter records on one Redis connection.

    `records` is what the keyspace's tenant may read (public records and its own private
    ones), `all_records` what workers serve and the operator lists; `add` and `remove`
    keep the full hash and the tenants' views in step (`shared.adapter_views`).
    """

    def __init__(self, redis: Any, keys: KeySpace, model: str) -> None:
        self._redis = redis
        self._keys = keys
        self._model = model
        self._all = keys.model_adapters(model)
        self._public = keys.public_adapters(model)
        self._move = redis.register_script(MOVE_LUA)
        self._rebuild = redis.register_script(REBUILD_LUA)

    async def records(self) -> dict[str, AdapterRecord]:
        """The records the keyspace's tenant may read: the public ones and its own private
        ones (a tenant's credentials are refused the full hash).

        The public view, the tenant's view and the public view again, in one pipeline; a
        later read wins. A record moved between the two views meanwhile (one atomic script,
        between two of these reads) is in at least one of them, so a client never sees an
        adapter vanish while it is made public or private.
        """
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self._public)
            pipe.hgetall(self._keys.private_adapters(self._model))
            pipe.hgetall(self._public)
            read = await pipe.execute()
        merged: dict[Any, bytes] = {}
        for raw in read:
            merged.update(raw)
        return _decode(merged)

    async def all_records(self) -> dict[str, AdapterRecord]:
        """Every well-formed record, public and private (workers and the operator only)."""
        return _decode(await self._redis.hgetall(self._all))

    async def add(self, record: AdapterRecord) -> None:
        """Publish `record` (replacing one of the same name, public or private)."""
        await self._replace(record.name, record)

    async def remove(self, name: str) -> bool:
        """Withdraw an adapter; whether it was there. Workers stop serving it at their next
        refresh."""
        return await self._replace(validate_adapter_name(name), None)

    async def rebuild_views(self) -> None:
        """Write the public view and each private view again from the full hash.

        Only the views of tenants that own a record now are written: a view left behind by a
        record changed by hand stays (it lists nothing its tenant may not see).
        """
        for _ in range(_WRITE_TRIES):
            raw = await self._redis.hgetall(self._all)
            entries = []
            for field, value in raw.items():
                name = field if isinstance(field, bytes) else str(field).encode()
                entries.append((name, value, self._view_of_raw(name.decode(), value)))
            keys, args = rebuild_arguments(self._all, self._public, entries)
            if await self._rebuild(keys=keys, args=args):
                return
        raise Busy(f"the adapter records of {self._model!r} kept changing while read")

    async def _replace(self, name: str, record: AdapterRecord | None) -> bool:
        """Put `record` under `name` (None: remove it); whether a record was there."""
        for _ in range(_WRITE_TRIES):
            old = await self._redis.hget(self._all, name)
            if old is None and record is None:
                return False
            new_view = self._view_of(record) if record is not None else None
            old_view = self._view_of_raw(name, old) if old is not None else None
            keys = [self._all, old_view or new_view or self._public, new_view or self._public]
            new = record.to_bytes() if record is not None else b""
            if await self._move(keys=keys, args=[name, old or b"", new]):
                return old is not None
        raise Busy(f"the adapter record {name!r} of {self._model!r} kept changing while written")

    def _view_of(self, record: AdapterRecord) -> str:
        """The view that lists `record`: the public one, or its tenant's private one."""
        if record.tenant is None:
            return self._public
        return self._keys.for_tenant(record.tenant).private_adapters(self._model)

    def _view_of_raw(self, name: str, raw: bytes) -> str | None:
        """The view of a record as stored (None: malformed, listed nowhere, served by none)."""
        try:
            return self._view_of(AdapterRecord.from_bytes(name, raw))
        except (MalformedMessage, InvalidName):
            return None


#: Reads and writes of the records before giving up when other writers keep coming between.
_WRITE_TRIES = 20


def _decode(raw: dict[Any, bytes]) -> dict[str, AdapterRecord]:
    """The well-formed records of a hash as read; a malformed one is skipped (no one may
    serve it)."""
    records = {}
    for field, value in raw.items():
        name = field.decode() if isinstance(field, bytes) else field
        try:
            records[name] = AdapterRecord.from_bytes(name, value)
        except (MalformedMessage, InvalidName):
            continue
    return records
