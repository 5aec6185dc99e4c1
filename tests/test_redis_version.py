"""A worker refuses a Redis older than 7.0 and warns about one without the 2026 ACL fixes.

The old Redis is the suite's real redis-server seen through `VersionProxy`, a loopback proxy
that rewrites only the ``redis_version`` line of INFO (tests/version_proxy.py): the worker's
own code path (INFO over its own connection) meets an old version without one installed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from version_proxy import VersionProxy

from lmqueue.devstack import LocalRedis, WorkerProcess, free_port
from lmqueue.shared.errors import SettingsError
from lmqueue.shared.redis_version import (
    MINIMUM,
    acl_fixed,
    check_redis_version,
    parse_version,
)


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("7.0.15", (7, 0, 15)),
        ("7.2", (7, 2, 0)),
        ("8.8.2-rc1", (8, 8, 2)),
        (" 6.2.14\n", (6, 2, 14)),
    ],
)
def test_versions_are_parsed_as_numbers(text: str, version: tuple[int, int, int]) -> None:
    assert parse_version(text) == version


def test_a_version_that_is_no_number_is_refused() -> None:
    with pytest.raises(ValueError, match="not a Redis version"):
        parse_version("unknown")


@pytest.mark.parametrize(
    ("version", "fixed"),
    [
        ((7, 0, 15), False), ((7, 2, 15), False), ((7, 2, 16), True), ((7, 4, 10), False),
        ((7, 4, 11), True), ((8, 0, 9), False), ((8, 2, 9), True), ((8, 8, 1), False),
        ((8, 8, 2), True), ((8, 10, 0), True), ((9, 0, 0), True),
    ],
)  # fmt: skip
def test_only_the_patched_releases_of_each_line_count_as_fixed(
    version: tuple[int, int, int], fixed: bool
) -> None:
    assert acl_fixed(version) is fixed


async def test_the_suites_redis_passes_and_is_warned_about_as_its_version_deserves(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        with caplog.at_level(logging.WARNING, logger="lmqueue.shared.redis_version"):
            version = await check_redis_version(client, redis_url)
    finally:
        await client.aclose()
    assert version is not None and version >= MINIMUM
    warned = [
        r.getMessage() for r in caplog.records if "lacks the 2026 ACL fixes" in r.getMessage()
    ]
    assert bool(warned) is not acl_fixed(version)


@pytest.mark.parametrize(("fake", "warns"), [("7.0", True), ("7.2", True), ("8.8", False)])
async def test_a_supported_redis_without_the_acl_fixes_is_served_with_a_warning(
    redis_server: LocalRedis, fake: str, warns: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with VersionProxy(redis_server.port, fake) as proxy:
        client = aioredis.Redis.from_url(proxy.url)
        try:
            with caplog.at_level(logging.WARNING, logger="lmqueue.shared.redis_version"):
                version = await check_redis_version(client, proxy.url)
        finally:
            await client.aclose()
    assert version == parse_version(proxy.fake)
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert (f"is Redis {proxy.fake}, which lacks" in messages) is warns


async def test_a_redis_older_than_the_minimum_is_refused_with_its_version_named(
    redis_server: LocalRedis,
) -> None:
    with VersionProxy(redis_server.port, "6.2") as proxy:
        assert redis.Redis.from_url(proxy.url).info("server")["redis_version"] == proxy.fake
        client = aioredis.Redis.from_url(proxy.url)
        try:
            with pytest.raises(SettingsError, match=rf"is Redis {proxy.fake}; lmqueue needs"):
                await check_redis_version(client, proxy.url)
        finally:
            await client.aclose()


async def test_an_unreachable_redis_is_left_to_the_workers_retries() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    client = aioredis.Redis.from_url(url)
    try:
        assert await check_redis_version(client, url, timeout_s=1) is None
    finally:
        await client.aclose()


def test_a_worker_started_on_a_redis_older_than_the_minimum_exits_naming_the_version(
    redis_server: LocalRedis, tmp_path: Path
) -> None:
    """A real worker process; the refusal comes before the model loads (no model is needed:
    the mock backend would load SmolLM2's tokenizer only after the check)."""
    with VersionProxy(redis_server.port, "6.2") as proxy:
        worker = WorkerProcess(
            "smollm2-135m", "mock", proxy.url, "old-redis", log_dir=tmp_path
        ).start()
        assert worker.process is not None
        code = worker.process.wait(60)
    log = worker.log()
    assert code == 2, log
    (line,) = [line for line in log.splitlines() if line.startswith("lmq worker:")]
    assert f"SettingsError: the queue Redis at {proxy.url} is Redis {proxy.fake}" in line
    assert "lmqueue needs Redis 7.0.0 or later" in line and "upgrade Redis" in line
    assert "loading mock backend" not in log


@pytest.mark.cluster
async def test_on_a_redis_cluster_every_node_answers_and_the_oldest_counts(
    cluster_url: str,
) -> None:
    from lmqueue.shared.connections import connect_async_redis

    client = await connect_async_redis(cluster_url)
    try:
        info = await client.info("server", target_nodes=client.ALL_NODES)
        assert "redis_version" not in info and len(info) >= 3  # one reply per node
        version = await check_redis_version(client, cluster_url)
    finally:
        await client.aclose()
    assert version == min(parse_version(str(node["redis_version"])) for node in info.values())
