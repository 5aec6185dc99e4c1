"""`Planes`: the scheduler's two Redis roles, connected and checked once at start.

The data plane (`SchedulerSettings.redis_url`) holds what tenants see: their experiment
inboxes, indexes, records and results, next to their request streams, so a tenant's client
needs its one URL. It may be a Redis Cluster (detected from the server, as everywhere).

The control plane (`SchedulerSettings.control_url`) holds arq's keys and the scheduler's own
(the tenants' running leases under ``<prefix>:_sched:``). It must be a single instance: arq
speaks to one Redis, and its keys (``arq:queue``, ``arq:job:<id>``, ``arq:in-progress:<id>``,
...) are used together in transactions that would span hash slots. Without a control URL the
data URL serves both roles, which only a single instance can do: a cluster data URL without
a control URL is refused here with a `SettingsError` instead of failing later with CROSSSLOT.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from arq.connections import RedisSettings as ArqRedisSettings

from lmqueue.shared.connections import is_cluster
from lmqueue.shared.errors import SettingsError
from lmqueue.shared.redis_roles import connect_queue
from lmqueue.shared.settings import RedisSettings

from .settings import SchedulerSettings

__all__ = ["Planes", "open_planes", "arq_settings"]


@dataclass(frozen=True)
class Planes:
    """The data client (cluster or plain), the control client (plain) and its URL."""

    data: Any
    control: Any
    control_url: str


@contextlib.asynccontextmanager
async def open_planes(settings: SchedulerSettings) -> AsyncIterator[Planes]:
    """Connect both roles for the lifespan of a scheduler process.

    Raises:
        SettingsError: if the control plane would be a cluster (no control URL beside a
            cluster data URL, or a control URL naming a cluster node).
    """
    # the login is checked at once: a wrong password is AuthenticationFailed, not retried
    data = await connect_queue(RedisSettings(url=settings.redis_url))
    control = data
    try:
        if settings.control_url is None:
            if is_cluster(data):
                raise SettingsError(
                    f"--redis-url {_where(settings.redis_url)} is a Redis Cluster node: arq and "
                    "the scheduler's own keys need a single instance; give one with "
                    "--control-url or LMQ_CONTROL_URL (control_url in --config)"
                )
            control_url = settings.redis_url
        else:
            control = await connect_queue(RedisSettings(url=settings.control_url))
            if is_cluster(control):
                raise SettingsError(
                    f"--control-url {_where(settings.control_url)} is a Redis Cluster node: "
                    "arq and the scheduler's own keys need a single instance"
                )
            control_url = settings.control_url
        yield Planes(data, control, control_url)
    finally:
        if control is not data:
            await control.aclose()
        await data.aclose()


def arq_settings(url: str) -> ArqRedisSettings:
    """arq's connection settings for `url`, with the TLS options of its query, which arq's
    ``from_dsn`` drops (a ``rediss://`` control URL names its CA as the data URLs do)."""
    settings = ArqRedisSettings.from_dsn(url)
    query = {name: values[-1] for name, values in parse_qs(urlsplit(url).query).items()}
    tls: dict[str, Any] = {}
    if "ssl_ca_certs" in query:
        tls["ssl_ca_certs"] = query["ssl_ca_certs"]
    if "ssl_check_hostname" in query:
        tls["ssl_check_hostname"] = query["ssl_check_hostname"].lower() in ("1", "true", "yes")
    return dataclasses.replace(settings, **tls)


def _where(url: str) -> str:
    """`url` without credentials, for messages."""
    return url.rsplit("@", 1)[-1]
