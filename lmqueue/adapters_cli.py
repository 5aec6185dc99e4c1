"""``lmq adapter``: publish, list and withdraw a model's LoRA adapters, without restarting workers.

    lmq adapter add MODEL NAME=PATH [--tenant T]     serve the PEFT adapter in PATH as NAME
    lmq adapter list MODEL                           name, owner, revision, path of each
                                                     (a tenant: public ones and its own)
    lmq adapter remove MODEL NAME                    stop serving it

``add`` reads the adapter directory (it must be the path the workers see too: a shared or
identical file system) to record a digest of its files; workers load the record within a few
seconds (their tenant refresh) and refuse it if their copy differs. ``--tenant`` makes the
adapter private to that tenant: no other tenant can read its record (name, directory,
revision), their clients report the name unknown and a worker refuses a request naming it
(`Forbidden`), and its rows are cached in the tenant's own namespace only. ``add`` again
with or without ``--tenant`` makes a published adapter private or public (or another
tenant's); workers keep serving it meanwhile. A name already published with other files is
refused unless ``--replace`` is given (workers then forget every row of the old weights).
``--redis-url`` carries the operator's admin credentials (default: ``$LMQ_REDIS_URL``).

``list`` shows every adapter to the operator. With a tenant's URL it shows what that tenant
may use, the public adapters and its own private ones: Redis refuses a tenant the model's
full hash of records (NOPERM), and another tenant's private records too, so what a tenant
is shown is decided by Redis, not by this command.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

from redis.exceptions import NoPermissionError

from lmqueue.shared.adapters import (
    AdapterRecord,
    AdapterRegistry,
    adapter_revision,
    parse_adapter_spec,
)
from lmqueue.shared.connections import connect_async_redis
from lmqueue.shared.errors import SettingsError
from lmqueue.shared.keys import validate_name
from lmqueue.shared.redis_errors import redis_boundary
from lmqueue.shared.settings import RedisSettings, url_user

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``lmq adapter`` verbs."""
    parser.add_argument("--redis-url", default=None, help="admin URL (default: $LMQ_REDIS_URL)")
    verbs = parser.add_subparsers(dest="verb", required=True)
    add = verbs.add_parser("add", help="publish an adapter (workers load it within seconds)")
    add.add_argument("model")
    add.add_argument("spec", metavar="NAME=PATH", help="adapter name and PEFT directory")
    add.add_argument("--tenant", default=None, help="private to this tenant (default: public)")
    add.add_argument("--replace", action="store_true", help="give an existing name new files")
    verbs.add_parser("list", help="list a model's adapters").add_argument("model")
    remove = verbs.add_parser("remove", help="withdraw an adapter")
    remove.add_argument("model")
    remove.add_argument("name")


def run(args: argparse.Namespace) -> int:
    """Run one ``lmq adapter`` verb; prints what it did."""
    redis_settings = RedisSettings.from_env()
    url = args.redis_url or redis_settings.url
    return asyncio.run(_run(args, url, redis_settings))


async def _run(args: argparse.Namespace, url: str, redis_settings: RedisSettings) -> int:
    validate_name("model", args.model)
    redis = await connect_async_redis(url, redis_settings.connect_timeout_s)
    try:
        with redis_boundary(f"lmq adapter {args.verb}"):
            registry = AdapterRegistry(redis, redis_settings.keyspace(), args.model)
            if args.verb == "add":
                record = await _add(registry, args)
                owner = f"private to {record.tenant}" if record.tenant else "public"
                print(f"added {record.name} ({owner}, revision {record.revision}) to {args.model}")
            elif args.verb == "list":
                records = await _visible_records(redis, url, redis_settings, args.model)
                for name, record in sorted(records.items()):
                    owner = record.tenant or "public"
                    print(f"{name}\t{owner}\t{record.revision}\t{record.path}")
            else:
                if not await registry.remove(args.name):
                    raise SettingsError(f"model {args.model!r} has no adapter {args.name!r}")
                print(f"removed {args.name} from {args.model}")
    finally:
        await redis.aclose()
    return 0


async def _visible_records(
    redis: Any, url: str, redis_settings: RedisSettings, model: str
) -> dict[str, AdapterRecord]:
    """Every record for the operator; for a tenant (Redis refuses it the full hash), the
    public ones and those private to the tenant its URL names."""
    keys = redis_settings.keyspace()
    try:
        return await AdapterRegistry(redis, keys, model).all_records()
    except NoPermissionError:
        tenant = url_user(url) or keys.tenant
        return await AdapterRegistry(redis, keys.for_tenant(tenant), model).records()


async def _add(registry: AdapterRegistry, args: argparse.Namespace) -> AdapterRecord:
    name, path = parse_adapter_spec(args.spec)
    if args.tenant is not None:
        validate_name("tenant", args.tenant)
    try:
        revision = await asyncio.to_thread(adapter_revision, path)
    except FileNotFoundError as exc:
        raise SettingsError(str(exc)) from None
    record = AdapterRecord(name, os.path.abspath(path), revision, args.tenant)
    old = (await registry.all_records()).get(name)
    if old is not None and _files(old) != _files(record) and not args.replace:
        raise SettingsError(
            f"adapter {name!r} is published already (revision {old.revision}, "
            f"{old.tenant or 'public'}); pass --replace to give it these files"
        )
    await registry.add(record)
    return record


def _files(record: AdapterRecord) -> tuple[str, str]:
    """What decides an adapter's rows (its owner does not)."""
    return record.path, record.revision
