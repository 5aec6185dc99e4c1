"""``lmq tenant``: create, change, list and remove tenants, and make the workers' user.

    lmq tenant add NAME [--weight W] [--max-inflight N] [--max-tokens-per-s R]
                        [--cache-namespace NS]                  prints the URL to give NAME
    lmq tenant set NAME [same options] [--new-password]
    lmq tenant list
    lmq tenant remove NAME
    lmq tenant worker-user [--name lmq-worker]                  prints the workers' URL
    lmq tenant reapply [--worker-user lmq-worker]               this version's rules for all

``--redis-url`` carries the operator's admin credentials (default: ``$LMQ_REDIS_URL``, else
``$REDIS_URL``, else 127.0.0.1:6379, said on stderr); the URL printed first carries the same
host and port with the new user's, and is all the tenant's programs need. With a separate
cache instance the same user is made there too, with the same password: at ``--cache-url``
(its admin URL) if given, else at the address the workers publish in the registry, with the
admin URL's credentials. Every change reaches every instance or none. The connection flags go
before or after the action (``lmq tenant add acme --redis-url ...``).
"""

from __future__ import annotations

import argparse
from typing import Any

from lmqueue.shared.connections import sync_redis
from lmqueue.shared.redis_errors import redis_boundary
from lmqueue.shared.settings import same_instance, url_without_credentials, with_credentials_of
from lmqueue.shared.tenants import WORKER_USER, TenantConfig

from .connection_url import admin_url
from .tenant_admin import TenantAdmin

__all__ = ["add_arguments", "run"]

_LIMITS = ("weight", "max_inflight", "max_tokens_per_s", "cache_namespace")


def _limit_options(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """The per-tenant settings; `set` leaves unnamed ones as they are (default None)."""

    def default(value: Any) -> Any:
        return value if defaults else None

    parser.add_argument(
        "--weight",
        type=float,
        default=default(1.0),
        help="share of each worker relative to other busy tenants (default 1)",
    )
    parser.add_argument(
        "--max-inflight",
        type=int,
        default=default(0),
        help="requests queued or running at once, per model (0: unlimited)",
    )
    parser.add_argument(
        "--max-tokens-per-s",
        type=float,
        default=default(0.0),
        help="prompt tokens admitted per second, per model (0: unlimited)",
    )
    parser.add_argument("--cache-namespace", default=None,
                        help="pool.<name> to share cached results with tenants naming the same "
                        "pool (default: the tenant's own, private)")  # fmt: skip


def _connection_options(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """``--redis-url``, ``--cache-url`` and ``--prefix``: accepted before the action (as
    before) and after it (as on every other command); the later one wins."""

    def default(value: Any) -> Any:
        return value if defaults else argparse.SUPPRESS

    parser.add_argument(
        "--redis-url",
        default=default(None),
        help="admin URL (default: $LMQ_REDIS_URL, else $REDIS_URL)",
    )
    parser.add_argument(
        "--cache-url",
        default=default(None),
        help="admin URL of a separate cache instance (default: the address "
        "the workers publish, with the --redis-url credentials)",
    )
    parser.add_argument("--prefix", default=default("lmq"), help="key prefix (default lmq)")
    # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``lmq tenant`` subcommands and their flags."""
    _connection_options(parser, defaults=True)
    actions = parser.add_subparsers(dest="action", required=True)
    add = actions.add_parser("add", help="create a tenant; prints the URL to give it")
    add.add_argument("name")
    _limit_options(add, defaults=True)
    change = actions.add_parser("set", help="change a tenant's settings")
    change.add_argument("name")
    _limit_options(change, defaults=False)
    change.add_argument("--new-password", action="store_true", help="rotate; prints the new URL")
    listing = actions.add_parser("list", help="list tenants and their settings")
    remove = actions.add_parser("remove", help="delete a tenant's user and settings")
    remove.add_argument("name")
    worker = actions.add_parser("worker-user", help="create or reset the workers' ACL user")
    worker.add_argument("--name", default=WORKER_USER)
    reapply = actions.add_parser(
        "reapply", help="give every tenant and the workers' user this version's rules "
        "(after an upgrade; passwords stay)",
    )  # fmt: skip
    reapply.add_argument("--worker-user", default=WORKER_USER)
    for action in (add, change, listing, remove, worker, reapply):
        _connection_options(action, defaults=False)


def run(args: argparse.Namespace) -> int:
    """Carry out one ``lmq tenant`` action; 0 on success."""
    url = admin_url(args.redis_url, "lmq tenant")
    redis = sync_redis(url)
    caches: list[tuple[Any, str]] = []
    try:
        with redis_boundary(f"lmq tenant {args.action}", url):
            for cache_url in _cache_urls(redis, url, args):
                caches.append((sync_redis(cache_url), cache_url))
            admin = TenantAdmin(redis, url, args.prefix, caches=caches)
            return _act(admin, args)
    finally:
        redis.close()
        for cache, _ in caches:
            cache.close()


def _cache_urls(redis: Any, url: str, args: argparse.Namespace) -> list[str]:
    """The deployment's other instances: ``--cache-url``, else the cache addresses the
    workers publish, reached with the admin URL's credentials."""
    if args.cache_url:
        found = [args.cache_url]
    else:
        published = TenantAdmin(redis, url, args.prefix).published_cache_addresses()
        found = [with_credentials_of(address, url) for address in published]
    return [found_url for found_url in found if not same_instance(found_url, url)]


def _act(admin: TenantAdmin, args: argparse.Namespace) -> int:
    if args.action == "add":
        values = {k: getattr(args, k) for k in _LIMITS if getattr(args, k) is not None}
        print(admin.add(TenantConfig(args.name, **values)))
    elif args.action == "set":
        changes = {k: getattr(args, k) for k in _LIMITS if getattr(args, k) is not None}
        new_url = admin.set(args.name, new_password=args.new_password, **changes)
        print(new_url or f"updated tenant {args.name}")
    elif args.action == "list":
        _print_table(admin)
    elif args.action == "remove":
        admin.remove(args.name)
        print(f"removed tenant {args.name}")
    elif args.action == "reapply":
        users = admin.reapply_rules(args.worker_user)
        print(f"applied this version's rules to {', '.join(users) or 'no user'}")
    else:
        print(admin.worker_user(args.name))
    if args.action != "list":
        for _, cache_url in admin.caches:
            print(
                f"note: the same user on the cache instance {url_without_credentials(cache_url)}"
                " (clients find it in the registry: the URL above is all they need)"
            )
        if admin.acl_file() is None:
            print("note: Redis has no aclfile; these users last only until Redis restarts")
    return 0


def _print_table(admin: TenantAdmin) -> None:
    rows = admin.tenants()
    print(f"{'tenant':20} {'weight':>7} {'inflight':>9} {'tokens/s':>9}  cache      user")
    for row in rows:
        c = row.config
        print(f"{c.name:20} {c.weight:7g} {c.max_inflight or '-':>9} "
              f"{c.max_tokens_per_s or '-':>9}  {c.cache_namespace:10} "
              f"{'yes' if row.has_user else 'MISSING'}")  # fmt: skip
