"""`AdapterSet`: the LoRA adapters one worker serves, kept in step with the model's registry.

A worker loads the adapters of its command line (``--adapter NAME=PATH``) before it serves,
and publishes them (public), then writes the tenants' views of the records again from the
model's full hash (`AdapterRegistry.rebuild_views`: records written before the views existed
get theirs). Every few seconds (the tenant refresh) it reads the full hash, which holds
every adapter, public and private, and loads what was added (``lmq adapter add``), unloads
what was removed, and reloads an adapter whose files changed. An adapter made public or
private stays served throughout: its record (who may use it, where its rows are cached) is
swapped in place, and one that was private is loaded again in place, which forgets what was
computed for its former owner (`_change_owner`). An adapter is served only once its
directory, read by this worker, has the revision its record names: a worker never serves rows
under a cache key whose weights it does not hold.

The processor checks every request's adapter here: a name not served is `UnknownAdapter`
(listing only the adapters the requesting tenant may use), another tenant's private adapter
is `Forbidden`. The client checks too, but a client is not trusted.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from lmqueue.shared.adapters import AdapterRecord, AdapterRegistry, adapter_revision, check_adapter
from lmqueue.shared.errors import AdaptersUnsupported, SettingsError
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.lm.interface import AsyncLM

__all__ = ["AdapterSet"]

logger = logging.getLogger(__name__)


class AdapterSet:
    """The adapters a worker's backend holds, by name, with the records they were loaded by.

    `served` is shared (the same dict) with every lane's shared cache, which keys adapters'
    rows by the record's revision and tenant.

    Raises:
        AdaptersUnsupported: adapters are given on the command line and the backend cannot
            serve them.
    """

    def __init__(
        self, backend: AsyncLM, redis: Any, keys: KeySpace, model: str, own: dict[str, str]
    ) -> None:
        if own and not backend.supports_adapters:
            raise AdaptersUnsupported(
                f"the {backend.backend_name} backend cannot serve LoRA adapters "
                f"({', '.join(sorted(own))} given with --adapter); use --backend hf or vllm"
            )
        self.backend = backend
        self.registry = AdapterRegistry(redis, keys, model)
        self.served: dict[str, AdapterRecord] = {}
        self._own = dict(own)
        self._own_records: dict[str, AdapterRecord] = {}
        #: Revisions that failed to load, by name: not tried again until the record changes.
        self._failed: dict[str, str] = {}
        self._unsupported_logged = False
        #: one refresh at a time: the upkeep loop's and a batch's (see `refresh`) may meet
        self._refreshing = asyncio.Lock()

    async def publish_own(self) -> None:
        """Load the command line's adapters (once; a failure stops the worker), and publish
        their records (again after a Redis restart)."""
        for name, path in self._own.items():
            record = self._own_records.get(name)
            if record is None:
                try:
                    revision = await asyncio.to_thread(adapter_revision, path)
                    await self.backend.load_adapter(name, path)
                except Exception as exc:
                    raise SettingsError(f"--adapter {name}={path}: {exc}") from exc
                record = self._own_records[name] = AdapterRecord(
                    name, os.path.abspath(path), revision
                )
                self.served[name] = record
                logger.info("serving adapter %s (revision %s) from %s", name, revision, path)
            await self.registry.add(record)
        await self.registry.rebuild_views()

    async def refresh(self) -> None:
        """Load added adapters, unload removed or changed ones (the registry's records).

        Also called for a batch naming an adapter not loaded here before it is refused: a
        peer's ``--adapter`` or ``lmq adapter add`` may have published it since the last
        refresh, and the client, which read the registry, asked for it rightly (one HGETALL
        of the records when nothing changed).
        """
        async with self._refreshing:
            await self._refresh()

    async def _refresh(self) -> None:
        records = await self.registry.all_records()
        if not self.backend.supports_adapters:
            if records and not self._unsupported_logged:
                logger.warning("the %s backend serves no adapters; requests naming %s fail",
                               self.backend.backend_name, ", ".join(sorted(records)))  # fmt: skip
                self._unsupported_logged = True
            return
        for name, record in list(self.served.items()):
            new = records.get(name)
            if new == record:
                continue
            if new is not None and _same_weights(new, record):
                await self._change_owner(record, new)
                continue
            del self.served[name]  # first: no request is admitted for it meanwhile
            await self.backend.unload_adapter(name)
            logger.info("stopped serving adapter %s", name)
        for name, record in records.items():
            if name not in self.served and self._failed.get(name) != record.revision:
                await self._load(record)

    async def _change_owner(self, old: AdapterRecord, new: AdapterRecord) -> None:
        """An adapter made public or private (or given to another tenant): its name stays
        served all along, checked against the new record from now on.

        Rows computed for its former owner must not answer anyone else faster (a timing
        oracle on the owner's prompts): unless it was public, the backend loads it again
        in place, which forgets every result and KV computed with it.
        """
        self.served[new.name] = new
        logger.info("adapter %s is now %s", new.name, _owner(new))
        if old.tenant is not None:
            await self._load(new)

    async def _load(self, record: AdapterRecord) -> None:
        try:
            revision = await asyncio.to_thread(adapter_revision, record.path)
            if revision != record.revision:
                raise ValueError(
                    f"its files have revision {revision}, the record {record.revision}"
                )
            await self.backend.load_adapter(record.name, record.path)
        except Exception as exc:  # a bad record must not stop the worker: log, skip, go on
            self._failed[record.name] = record.revision
            logger.warning("cannot load adapter %s from %s: %s", record.name, record.path, exc)
            if self.served.pop(record.name, None) is not None:  # it was loaded in place
                await self.backend.unload_adapter(record.name)
            return
        self._failed.pop(record.name, None)
        self.served[record.name] = record
        logger.info("serving adapter %s (%s, revision %s)", record.name, _owner(record),
                    record.revision)  # fmt: skip

    def check(self, name: str | None, tenant: str) -> AdapterRecord | None:
        """The record of the adapter `tenant` names (None: the base model), or a typed error."""
        return check_adapter(self.served, name, tenant)


def _owner(record: AdapterRecord) -> str:
    return f"private to {record.tenant}" if record.tenant else "public"


def _same_weights(new: AdapterRecord, old: AdapterRecord) -> bool:
    """Whether `new` names the files `old` was loaded from (its owner may differ)."""
    return (new.path, new.revision) == (old.path, old.revision)
