"""`shared.connections.bounded`: the watchdog around every awaited Redis command.

What it promises: the command's result or its error as they are; past the time limit, the
command cancelled and ended before `RedisTimeoutError` is raised; a cancelled caller leaves at
once with the command cancelled; and neither a command that swallows its cancellation (as
redis-py's asyncio client did, RELIABILITY.md) nor the watchdog's timer can cancel the caller
or hide the caller's own cancellation. The last case runs on a real redis-server: a blocking
read that outlives its bound, then the same client serving the next command.
"""

from __future__ import annotations

import asyncio
import gc
import time

import pytest
from redis.exceptions import TimeoutError as RedisTimeoutError

from lmqueue.shared.connections import async_redis, bounded


async def _answer(value: int, delay_s: float = 0.0) -> int:
    await asyncio.sleep(delay_s)
    return value


class _Command:
    """A command that records how it ended; `stubborn` ones swallow their cancellation."""

    def __init__(self, stubborn: bool = False) -> None:
        self.stubborn = stubborn
        self.cancelled = False
        self.ended = False

    async def run(self, delay_s: float) -> str:
        try:
            await asyncio.sleep(delay_s)
        except asyncio.CancelledError:
            self.cancelled = True
            if not self.stubborn:
                raise
            return "swallowed"
        finally:
            self.ended = True
        return "done"


async def test_the_result_and_the_error_come_back_as_they_are() -> None:
    assert await bounded(_answer(7), 1.0, "answer") == 7
    assert await bounded(_answer(8, 0.01), 1.0, "answer") == 8

    async def failing() -> None:
        await asyncio.sleep(0)
        raise KeyError("no such thing")

    with pytest.raises(KeyError, match="no such thing"):
        await bounded(failing(), 1.0, "failing")


async def test_a_command_past_its_bound_is_cancelled_and_ended_before_the_error() -> None:
    command = _Command()
    started = time.monotonic()
    with pytest.raises(RedisTimeoutError, match="slow read got no answer in 0.05 s"):
        await bounded(command.run(10.0), 0.05, "slow read")
    assert time.monotonic() - started < 1.0
    assert command.cancelled and command.ended


async def test_a_command_that_swallows_its_cancellation_still_times_out() -> None:
    command = _Command(stubborn=True)
    with pytest.raises(RedisTimeoutError):
        await bounded(command.run(10.0), 0.05, "stubborn read")
    assert command.cancelled and command.ended
    assert asyncio.current_task().cancelling() == 0  # the caller was never cancelled


async def test_a_cancelled_caller_leaves_at_once_and_cancels_its_command() -> None:
    command = _Command()
    caller = asyncio.ensure_future(bounded(command.run(10.0), 30.0, "read"))
    await asyncio.sleep(0.02)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await asyncio.sleep(0)  # the command's cancellation is delivered on its next step
    assert command.cancelled and command.ended


async def test_a_command_swallowing_a_cancellation_cannot_hide_the_callers() -> None:
    # Awaiting the command's task directly would hand the caller its "swallowed" result.
    command = _Command(stubborn=True)
    caller = asyncio.ensure_future(bounded(command.run(10.0), 30.0, "read"))
    await asyncio.sleep(0.02)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await asyncio.sleep(0)
    assert command.cancelled and command.ended


async def test_an_answer_at_the_deadline_is_the_answer_not_a_timeout() -> None:
    # The timer and the command's end may fall in the same turn of the loop: whichever comes
    # first wakes the caller, and a command that ended is never reported as timed out.
    results = await asyncio.gather(
        *(bounded(_answer(i, 0.01), 0.01, "answer") for i in range(200)),
        return_exceptions=True,
    )
    for i, result in enumerate(results):  # its own answer, or a timeout: nothing else
        assert result == i or isinstance(result, RedisTimeoutError), (i, result)


async def test_a_real_blocking_read_past_its_bound_times_out_and_the_client_goes_on(
    redis_url: str,
) -> None:
    redis = async_redis(redis_url)
    try:
        started = time.monotonic()
        with pytest.raises(RedisTimeoutError, match="BLPOP got no answer"):
            await bounded(redis.blpop(["lmq:test:bounded:nothing"], timeout=5), 0.2, "BLPOP")
        assert time.monotonic() - started < 2.0
        await redis.rpush("lmq:test:bounded:list", b"x")
        assert await bounded(redis.lpop("lmq:test:bounded:list"), 5.0, "LPOP") == b"x"
    finally:
        await redis.delete("lmq:test:bounded:list")
        await redis.aclose()


async def test_a_caller_cancelled_as_its_command_failed_leaves_no_unretrieved_error() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    ended = asyncio.Event()

    async def failing() -> None:
        ended.set()
        raise ConnectionError("the server went away")

    try:
        caller = asyncio.ensure_future(bounded(failing(), 30.0, "read"))
        await ended.wait()  # the command failed; the caller has not resumed yet
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        del caller
        await asyncio.sleep(0)  # the abandoned command's callbacks run
        gc.collect()
    finally:
        loop.set_exception_handler(None)
    assert not [c for c in reported if "never retrieved" in str(c.get("message"))], reported
