"""A tenant's program needs only the URL ``lmq tenant add`` printed, with a separate cache.

Two real redis-servers (queue and cache), users made by ``lmq tenant``, a real worker
process logged in as the workers' user on both; clients given nothing but a tenant's URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time
from collections.abc import Iterator

import pytest
import redis
import torch

from lmqueue.cli import main
from lmqueue.devstack import LocalRedis, WorkerProcess
from lmqueue.producer import QueueLM
from lmqueue.shared.errors import AuthenticationFailed
from lmqueue.shared.keys import KeySpace
from lmqueue.workers.backends.mock import MockAsyncLM

MODEL = "smollm2-135m"


def _tenant(capsys: object, *args: str) -> str:
    """The first line `lmq tenant ...` printed (exit 0 asserted)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["tenant", *args])
    assert code == 0
    return out.getvalue().splitlines()[0]


@pytest.fixture(scope="module")
def deployment(
    redis_server: LocalRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, LocalRedis]]:
    """A queue (the session server) and a cache instance, a worker serving from both."""
    redis_url, tmp_path, capsys = redis_server.url, tmp_path_factory.mktemp("one-url"), None
    admin = redis.Redis.from_url(redis_url)
    admin.flushall()  # no registry entry left by another module's worker
    with LocalRedis(policy="allkeys-lru") as cache:
        worker_url = _tenant(capsys, "worker-user", "--redis-url", redis_url,
                             "--cache-url", cache.url)  # fmt: skip
        worker_cache_url = worker_url.split("@")[0] + "@" + cache.url.split("//")[1]
        worker = WorkerProcess(MODEL, "mock", worker_url, "one-url-0", log_dir=tmp_path,
                               extra_args=["--cache-url", worker_cache_url]).start()  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while not admin.exists(KeySpace().model_info(MODEL)):
                assert time.monotonic() < deadline and worker.alive, worker.log()
                time.sleep(0.2)
            yield redis_url, cache
        finally:
            assert worker.stop() == 0, worker.log()
            assert "***@" in worker.log() or "@" not in worker.log()  # no password logged
            for client in (admin, redis.Redis.from_url(cache.url)):
                users = [u.decode() for u in client.execute_command("ACL", "USERS")]
                client.execute_command("ACL", "DELUSER", *[u for u in users if u != "default"])
                client.close()


async def test_a_tenant_url_alone_reaches_the_workers_cache(
    deployment: tuple[str, LocalRedis],
    capsys: pytest.CaptureFixture[str],
    smol_tokenizer: object,
) -> None:
    queue_url, cache = deployment
    alice_url = _tenant(capsys, "add", "alice", "--redis-url", queue_url,
                        "--cache-url", cache.url)  # fmt: skip
    prompts = [[i, i + 1, i + 2] for i in range(40)]
    reference = MockAsyncLM(smol_tokenizer)
    async with await QueueLM.connect(MODEL, alice_url, connect_timeout_s=60) as lm:
        assert lm.info.cache_address == cache.url
        first = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
        lm.clear_cache()
        second = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
        stats = lm.stats
    for prompt, a, b in zip(prompts, first, second, strict=True):
        assert torch.equal(a, reference.logprobs_of(prompt)) and torch.equal(a, b)
    # every first answer a claim-check redeemed at the cache, every second a cache hit there
    assert stats["claims_resolved"] == len(prompts) and stats["claims_missed"] == 0, stats
    assert stats["cache_hits"] == len(prompts) and stats["sent"] == len(prompts), stats
    keys = redis.Redis.from_url(cache.url).keys("lmq:alice:cache:*")
    assert len(keys) == len(prompts)


async def test_a_client_without_a_cache_user_says_so_once_and_costs_no_double_work(
    deployment: tuple[str, LocalRedis],
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    queue_url, cache = deployment
    # made on the queue instance only (as an older lmq did): no user at the cache
    bob_url = _tenant(capsys, "add", "bob", "--redis-url", queue_url, "--cache-url", queue_url)
    prompts = [[7, i, i + 1] for i in range(40)]
    with caplog.at_level(logging.WARNING):
        async with await QueueLM.connect(MODEL, bob_url, connect_timeout_s=60) as lm:
            await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
            stats = lm.stats
    warnings = [r.getMessage() for r in caplog.records if "shared cache" in r.getMessage()]
    assert len(warnings) == 1 and "cannot be used" in warnings[0]
    assert "wrong user or password" in warnings[0] and bob_url.split("@")[0] not in warnings[0]
    # asked inline from the start: one request per prompt, no claim-check to miss
    assert stats["sent"] == len(prompts) and stats["claims_missed"] == 0, stats
    assert stats["claims_resolved"] == 0, stats


async def test_a_wrong_password_fails_at_once_as_authentication_failed(
    deployment: tuple[str, LocalRedis], capsys: pytest.CaptureFixture[str]
) -> None:
    queue_url, _ = deployment
    url = _tenant(capsys, "add", "carol", "--redis-url", queue_url, "--cache-url", queue_url)
    wrong = url.split(":")[0] + ":" + url.split(":")[1] + ":not-the-password@" + url.split("@")[1]
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(AuthenticationFailed) as caught:
        await QueueLM.connect(MODEL, wrong, connect_timeout_s=60)
    assert loop.time() - started < 2.0  # not retried until the 60 s connect timeout
    assert "wrong user or password" in str(caught.value)
    assert "not-the-password" not in str(caught.value) and "carol:***@" in str(caught.value)


def test_the_demo_samples_through_the_deployments_workers_with_a_tenant_url(
    deployment: tuple[str, LocalRedis],
) -> None:
    import os
    import subprocess
    import sys

    queue_url, cache = deployment
    dana_url = _tenant(None, "add", "dana", "--redis-url", queue_url)  # the published cache
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMQ_") and k != "REDIS_URL"}
    done = subprocess.run(
        [sys.executable, "-m", "lmqueue", "demo", "--workers", "0", "--redis-url", dana_url,
         "--steps", "3", "--particles", "2"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "next-token calls" in done.stdout
    assert dana_url.split("@")[0].split(":")[-1] not in done.stdout + done.stderr  # no password
    assert b"dana" in redis.Redis.from_url(cache.url).execute_command("ACL", "USERS")
