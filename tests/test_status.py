"""`lmq status` against a real redis-server holding a known backlog."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import redis.exceptions
from prometheus_client.parser import text_string_to_metric_families

from lmqueue import status as status_command
from lmqueue.devstack import LocalRedis
from lmqueue.producer.admission import Admission
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.redis_roles import CACHE_POLICY
from lmqueue.shared.settings import RedisSettings, WorkerSettings
from lmqueue.shared.wire import Request, encode_request, ids_to_bytes
from lmqueue.shared.worker_stats import WorkerStats, read_worker_stats, write_worker_stats
from lmqueue.workers.backends.mock import MockAsyncLM
from lmqueue.workers.request_stream import RequestStream
from lmqueue.workers.worker import Worker

MODEL = "mock"
KEYS = KeySpace()


@pytest.fixture(scope="module")
def cache_server() -> Iterator[LocalRedis]:
    """A cache-role redis-server of its own (LRU, bounded)."""
    with LocalRedis(maxmemory="64mb", policy="allkeys-lru") as server:
        yield server


async def enqueue(aredis, keys: KeySpace, count: int, client: str = "c1") -> None:
    """Enqueue `count` requests the way clients do (the admission script)."""
    admission = Admission(aredis, keys.requests(MODEL), max_backlog=0)
    requests = [Request(f"{client}:{n}", client, ids_to_bytes([5, n])) for n in range(count)]
    await admission.enqueue([encode_request(r)["m"] for r in requests])


@pytest.fixture
async def fleet(aredis, redis_url, smol_tokenizer):
    """A published model with: 2 dead letters, 7 queued for `default` (3 of them taken by a
    worker), 2 queued for `bob`, one live worker with stats, and a cache with 1 hit, 1 miss."""
    settings = WorkerSettings(
        model=MODEL, backend="mock", redis=RedisSettings(url=redis_url), name="w1"
    )
    worker = Worker(settings, MockAsyncLM(smol_tokenizer), aredis)
    await worker.publish()
    for _ in range(2):
        await aredis.xadd(KEYS.requests(MODEL), {"m": b"not msgpack"})
    await worker.run_until_idle()
    await enqueue(aredis, KEYS, 7)
    await RequestStream(aredis, KEYS.requests(MODEL), "w1").read_new(3, None)
    await enqueue(aredis, KeySpace(tenant="bob"), 2, client="b1")
    stats = WorkerStats(
        MODEL, "mock", "mock-v1", ("default", "bob"), batch_size=32, batches_total=12,
        requests_total=40, batches_per_s=1.5, requests_per_s=6.0, shared_cache_hits=3,
        shared_cache_misses=1,
    )  # fmt: skip
    await write_worker_stats(aredis, KEYS, "w1", stats, ttl_s=30)
    return stats


@pytest.fixture
async def cache_redis(cache_server):
    client = aioredis.Redis.from_url(cache_server.url)
    await client.flushall()
    await client.config_resetstat()
    await client.set("lmq:default:cache:k", b"v")
    assert await client.get("lmq:default:cache:k") == b"v"
    assert await client.get("lmq:default:cache:gone") is None
    yield client
    await client.aclose()


async def test_status_reports_backlog_pending_age_dead_letters_workers_and_cache(
    aredis, fleet, cache_redis
) -> None:
    status = await status_command.collect_status(
        aredis, KEYS, cache_redis, tenants=["default", "bob"]
    )
    model = status["models"][MODEL]
    assert model["backlog"] == 9
    default, bob = model["tenants"]["default"], model["tenants"]["bob"]
    assert (default["backlog"], default["pending"], default["undelivered"]) == (7, 3, 4)
    assert default["dead_letters"] == 2
    assert (bob["backlog"], bob["pending"], bob["undelivered"], bob["dead_letters"]) == (2, 0, 2, 0)
    first_id = (await aredis.xrange(KEYS.requests(MODEL), count=1))[0][0].decode()
    expected_age_s = (status["time_ms"] - int(first_id.split("-")[0])) / 1000
    assert default["oldest_age_s"] == pytest.approx(expected_age_s) and 0 <= expected_age_s < 10
    worker = model["workers"]["w1"]
    assert 0 <= worker["heartbeat_age_s"] < 10
    assert worker["tenants"] == ["default", "bob"] and worker["backend"] == "mock"
    assert (worker["batches_per_s"], worker["requests_total"]) == (1.5, 40)
    assert worker["shared_cache_hit_rate"] == 0.75
    cache = status["cache"]
    assert cache["maxmemory_policy"] == "allkeys-lru" and cache["maxmemory_bytes"] == 64 << 20
    assert (cache["keyspace_hits"], cache["keyspace_misses"], cache["hit_rate"]) == (1, 1, 0.5)
    assert status["queue"]["maxmemory_policy"] == "noeviction"


async def test_a_model_nobody_asked_for_shows_zeros_and_no_age(aredis, redis_url) -> None:
    await aredis.sadd(KEYS.models(), "idle")
    await aredis.hset(KEYS.tenants(), "alice", "{}")  # a tenant the operator added
    status = await status_command.collect_status(aredis, KEYS)
    idle = status["models"]["idle"]
    assert sorted(idle["tenants"]) == ["alice", "default"]
    assert idle["tenants"]["default"] == idle["tenants"]["alice"] == {
        "backlog": 0, "pending": 0, "undelivered": 0, "oldest_age_s": None, "dead_letters": 0,
    }  # fmt: skip
    assert idle["workers"] == {}
    # no cache role of its own: the queue instance is reported as the cache
    assert status["cache"]["maxmemory_policy"] == status["queue"]["maxmemory_policy"]


async def fetch(url: str) -> tuple[int, str, bytes]:
    """Status, content type and body of one real HTTP GET."""

    def get() -> tuple[int, str, bytes]:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status, response.headers["Content-Type"], response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.headers["Content-Type"], error.read()

    return await asyncio.to_thread(get)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    status_command.add_arguments(parser)
    return parser.parse_args(argv)


async def test_the_command_prints_json_and_text(redis_url, fleet, cache_server, capsys) -> None:
    argv = ["--redis-url", redis_url, "--cache-url", cache_server.url, "--tenant", "default"]
    # run() owns its event loop, as under `lmq`: give it a thread of its own
    assert await asyncio.to_thread(status_command.run, parse([*argv, "--json"])) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["models"][MODEL]["tenants"]["default"]["backlog"] == 7
    assert printed["cache"]["maxmemory_policy"] == "allkeys-lru"
    assert await asyncio.to_thread(status_command.run, parse(argv)) == 0
    text = capsys.readouterr().out
    assert f"model {MODEL}: backlog 7" in text
    assert "w1" in text and "cache redis:" in text and "allkeys-lru" in text
    # an LRU cache: the operator is told why the shipped conf evicts the oldest entries instead
    assert f"ops/redis/cache.conf ships {CACHE_POLICY}" in text


def test_the_text_names_the_shipped_policy_only_for_a_cache_that_evicts_by_recency() -> None:
    def cache_lines(policy: str, same_instance: bool = False) -> list[str]:
        memory = {"used_memory_bytes": 1 << 20, "maxmemory_bytes": 64 << 20, "evicted_keys": 3,
                  "hit_rate": 0.5, "maxmemory_policy": policy}  # fmt: skip
        status = {"models": {}, "queue": {**memory, "maxmemory_policy": "noeviction"},
                  "cache": {**memory, "same_instance_as_queue": same_instance}}  # fmt: skip
        lines = status_command.render_text(status).splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("cache redis:"))
        return lines[at:]

    for policy in ("allkeys-lru", "allkeys-lfu", "volatile-random"):
        (_, hint) = cache_lines(policy)
        assert policy in hint and f"ships {CACHE_POLICY}" in hint
    assert len(cache_lines(CACHE_POLICY)) == 1
    assert len(cache_lines("noeviction")) == 1
    assert cache_lines("allkeys-lru", same_instance=True) == [
        "cache redis: the queue instance (no separate cache)"
    ]


def test_an_unreachable_redis_is_one_line_and_exit_code_1(capsys) -> None:
    from lmqueue.cli import main
    from lmqueue.devstack import free_port

    code = main(["status", "--redis-url", f"redis://127.0.0.1:{free_port()}/0"])
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("lmq status: Unavailable: ") and err.count("\n") == 1


async def test_worker_stats_round_trip_and_expire(aredis, redis_url) -> None:
    stats = WorkerStats(MODEL, "hf", "rev", ("a", "b"), 8, 1, 2, 3, 4, 0.5, 2.0, 5, 6)
    await write_worker_stats(aredis, KEYS, "w9", stats, ttl_s=7)
    assert await read_worker_stats(aredis, KEYS, MODEL, ["w9", "absent"]) == {"w9": stats}
    assert 0 < await aredis.ttl(KEYS.worker_stats(MODEL, "w9")) <= 7
    await aredis.hset(KEYS.worker_stats(MODEL, "w9"), "batches_total", "many")
    assert await read_worker_stats(aredis, KEYS, MODEL, ["w9"]) == {}


async def test_the_exporter_serves_the_status_as_metrics(aredis, fleet, cache_redis) -> None:
    from lmqueue.devstack import free_port
    from lmqueue.status_metrics import serve_status_metrics

    await aredis.zadd(KEYS.model_workers(MODEL), {"crashed": 1})  # a heartbeat from 1970
    port, stop = free_port(), asyncio.Event()
    exporter = asyncio.create_task(
        serve_status_metrics(aredis, KEYS, cache_redis, ["default", "bob"], None, port, 0.1, stop)
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            with contextlib.suppress(OSError):
                if (await fetch(f"{base}/readyz"))[0] == 200:
                    break
            await asyncio.sleep(0.05)
        status, _, body = await fetch(f"{base}/metrics")
        assert (await fetch(f"{base}/healthz"))[0] == 200
    finally:
        stop.set()
        await exporter
    assert status == 200
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }

    def at(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert at("lmq_backlog_requests", model=MODEL, tenant="default") == 7
    assert at("lmq_pending_requests", model=MODEL, tenant="default") == 3
    assert at("lmq_backlog_requests", model=MODEL, tenant="bob") == 2
    assert at("lmq_dead_letter_entries", model=MODEL, tenant="default") == 2
    assert 0 <= at("lmq_oldest_request_age_seconds", model=MODEL, tenant="default") < 10
    assert at("lmq_workers", model=MODEL, kind="live") == 1
    assert at("lmq_workers", model=MODEL, kind="stale") == 1
    assert at("lmq_redis_maxmemory_bytes", kind="cache") == 64 << 20
    assert at("lmq_redis_keyspace_hits_total", kind="cache") == 1
    assert at("lmq_status_refresh_timestamp_seconds") > 1.7e9


def documented_acl(user: str) -> list[str]:
    """The ``ACL SETUSER <user> ...`` line docs/OPERATIONS.md gives, as arguments."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "OPERATIONS.md").read_text()
    (line,) = [ln for ln in doc.splitlines() if ln.startswith(f"ACL SETUSER {user} ")]
    return line.replace(">PASSWORD", ">pw").split()[2:]


async def test_status_runs_as_the_documented_read_only_ops_user(aredis, redis_url, fleet) -> None:
    await aredis.execute_command("ACL", "SETUSER", "lmq-ops", *documented_acl("lmq-ops")[1:])
    port = redis_url.rsplit(":", 1)[1]
    ops = aioredis.Redis.from_url(f"redis://lmq-ops:pw@127.0.0.1:{port}")
    try:
        status = await status_command.collect_status(ops, KEYS)
        assert status["models"][MODEL]["tenants"]["default"]["backlog"] == 7
        assert status["models"][MODEL]["workers"]["w1"]["requests_total"] == 40
        with pytest.raises(redis.exceptions.NoPermissionError):
            await ops.xadd(KEYS.requests(MODEL), {"m": b"x"})
    finally:
        await ops.aclose()
        await aredis.execute_command("ACL", "DELUSER", "lmq-ops")


async def test_the_documented_keda_user_reads_only_stream_lengths(aredis, redis_url) -> None:
    await aredis.execute_command("ACL", "SETUSER", "lmq-keda", *documented_acl("lmq-keda")[1:])
    await aredis.xadd(KEYS.requests(MODEL), {"m": b"x"})
    port = redis_url.rsplit(":", 1)[1]
    keda = aioredis.Redis.from_url(f"redis://lmq-keda:pw@127.0.0.1:{port}")
    try:
        assert await keda.ping()
        assert await keda.xlen(KEYS.requests(MODEL)) == 1
        with pytest.raises(redis.exceptions.NoPermissionError):
            await keda.xrange(KEYS.requests(MODEL))
        with pytest.raises(redis.exceptions.NoPermissionError):
            await keda.xlen(KEYS.replies("c1"))
    finally:
        await keda.aclose()
        await aredis.execute_command("ACL", "DELUSER", "lmq-keda")


def test_watch_refreshes_until_interrupted(redis_url) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {k: v for k, v in os.environ.items() if not k.startswith("LMQ_")}
    command = [sys.executable, "-m", "lmqueue", "status", "--watch", "--interval", "0.1",
               "--redis-url", redis_url]  # fmt: skip
    lines: list[str] = []

    def default_sigint() -> None:  # a child inherits an ignored SIGINT, and then ignores ^C
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    with subprocess.Popen(
        command, stdout=subprocess.PIPE, env=env, preexec_fn=default_sigint
    ) as watcher:
        try:
            assert watcher.stdout is not None
            deadline = time.monotonic() + 60
            while sum("queue redis:" in line for line in lines) < 3:
                assert time.monotonic() < deadline and watcher.poll() is None, lines
                lines.append(watcher.stdout.readline().decode())
            watcher.send_signal(signal.SIGINT)
            rest, _ = watcher.communicate(timeout=30)  # reading on: a full pipe blocks its print
            lines.append(rest.decode())
            assert watcher.returncode == 0
        finally:
            watcher.kill()
    assert "\x1b[2J" not in "".join(lines)  # into a pipe: refreshes follow one another
    assert sum(line.startswith("redis redis://127.0.0.1:") for line in lines) >= 3


def test_a_killed_worker_is_marked_stale_and_one_instance_is_said_to_be_one(
    redis_url, tmp_path, capsys
) -> None:
    import time

    import redis as redis_sync

    from lmqueue.cli import main
    from lmqueue.devstack import WorkerProcess

    worker = WorkerProcess("smollm2-135m", "mock", redis_url, "doomed-0", log_dir=tmp_path)
    worker.start()
    admin = redis_sync.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + 60
        while not admin.zcard(KEYS.model_workers("smollm2-135m")):
            assert time.monotonic() < deadline and worker.alive, worker.log()
            time.sleep(0.2)
        worker.kill()
        # as if 20 s had passed since its last heartbeat
        admin.zadd(
            KEYS.model_workers("smollm2-135m"), {"doomed-0": int(time.time() * 1000) - 20_000}
        )
    finally:
        worker.stop()
        admin.close()
    password_url = redis_url.replace("redis://", "redis://default:pw-not-shown@")
    assert main(["status", "--redis-url", redis_url, "--model", "smollm2-135m"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0] == f"redis {redis_url}"
    assert "doomed-0: STALE, heartbeat silent for 20." in text
    assert "cache redis: the queue instance (no separate cache)" in text
    main(["status", "--redis-url", password_url])
    out, err = capsys.readouterr()
    assert "pw-not-shown" not in out + err and "default:***@" in out + err


def test_a_published_cache_the_user_cannot_read_is_said_and_the_queue_still_shown(
    redis_url, capsys
) -> None:
    import redis as redis_sync

    from lmqueue.cli import main
    from lmqueue.shared.registry import ModelInfo

    with LocalRedis() as cache:
        redis_sync.Redis.from_url(cache.url).config_set("requirepass", "not-yours")
        admin = redis_sync.Redis.from_url(redis_url)
        info = ModelInfo("m", "r", "mock", 10, 10, 0, cache_address=cache.url)
        admin.set(KEYS.model_info("m"), info.to_bytes())
        admin.sadd(KEYS.models(), "m")
        admin.close()
        assert main(["status", "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    assert "model m: backlog 0" in out
    assert "cache redis: a separate instance this user cannot read" in out
