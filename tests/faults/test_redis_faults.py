"""Redis restarting empty, and a network that delays, resets and blackholes connections."""

from __future__ import annotations

import asyncio

from .chaos_proxy import ChaosProxy
from .harness import Load, assert_clean, connect, make_prompts, probe, settled_streams


async def test_a_redis_restart_without_persistence_loses_no_request(
    fault_redis, workers, reference, record
):
    workers.spawn(
        fault_redis.url, 2, backend_opts={"batch_delay_s": 0.05}, env={"LMQ_BATCH_SIZE": "16"}
    )
    async with connect(fault_redis.url) as lm:
        load = Load(lm, make_prompts(800, seed=7))
        running = asyncio.create_task(load.run("redis-server killed and restarted empty"))
        await load.wait_done(200)
        answered_before = load.done
        await asyncio.to_thread(fault_redis.restart)
        figures = load.check(await running, reference)
        stats = lm.stats
        assert lm._refresh is not None  # the model's info was read again from the new server
        await lm._refresh
        info_reread = lm.info.revision == "mock-v1"
    async with probe(fault_redis.url) as redis:
        left = await settled_streams(redis)
    figures.extra.update(
        answered_before_restart=answered_before, server_restarts_seen=stats["server_restarts"],
        sent_including_resubmissions=stats["sent"], dead_letters=left["dead_letters"],
        model_info_reread=info_reread,
    )  # fmt: skip
    record(figures)
    assert_clean(figures)
    assert stats["server_restarts"] == 1 and stats["sent"] > 800


async def test_a_restart_while_the_reply_reader_holds_no_connection_is_still_noticed(
    fault_redis, workers, reference, record
):
    """The pool reconnects silently, so the reader sees no error; it must notice anyway."""
    workers.spawn(
        fault_redis.url, 2, backend_opts={"batch_delay_s": 0.05}, env={"LMQ_BATCH_SIZE": "16"}
    )
    async with connect(fault_redis.url, timeout_s=30) as lm:
        flowing, parked = asyncio.Event(), asyncio.Event()
        flowing.set()
        read = lm.channel.reader._read

        async def gated_read():
            parked.set()
            await flowing.wait()
            return await read()

        lm.channel.reader._read = gated_read
        load = Load(lm, make_prompts(800, seed=11))
        running = asyncio.create_task(load.run("redis restart while the reader is between reads"))
        await load.wait_done(200)
        flowing.clear()
        parked.clear()
        await parked.wait()  # between two reads: its connection is back in the pool
        await asyncio.to_thread(fault_redis.restart)
        flowing.set()
        figures = load.check(await running, reference)
        stats = lm.stats
    figures.extra.update(
        reader_errors_seen=stats["reconnects"], server_restarts_seen=stats["server_restarts"]
    )
    record(figures)
    assert_clean(figures)
    assert stats["server_restarts"] == 1


async def test_a_network_that_delays_resets_and_blackholes_loses_no_request(
    fault_redis, workers, reference, record
):
    with ChaosProxy(fault_redis.port) as proxy:
        workers.spawn(
            proxy.url, 2, backend_opts={"batch_delay_s": 0.05},
            env={"LMQ_BATCH_SIZE": "16", "LMQ_CLAIM_IDLE_MS": "1000", "LMQ_STALL_TIMEOUT_S": "1"},
        )  # fmt: skip
        async with connect(proxy.url, stall_timeout_s=1.0) as lm:
            load = Load(lm, make_prompts(800, seed=8))
            running = asyncio.create_task(
                load.run("chaos proxy: 50 ms latency, RST, 3 s blackhole")
            )
            await load.wait_done(100)
            proxy.set_latency(0.05)
            await asyncio.sleep(1.5)
            resets = await asyncio.to_thread(proxy.reset_all)
            await asyncio.sleep(0.5)
            proxy.blackhole()
            await asyncio.sleep(3.0)
            proxy.heal()
            figures = load.check(await running, reference)
            stats = lm.stats
            async with probe(proxy.url) as redis:
                left = await settled_streams(redis)
        figures.extra.update(
            connections_reset=resets, connections_accepted=proxy.accepted,
            client_reconnects=stats["reconnects"], dead_letters=left["dead_letters"],
        )  # fmt: skip
    record(figures)
    assert_clean(figures)
    assert resets > 0 and stats["server_restarts"] == 0
