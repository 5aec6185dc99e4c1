"""`Loop`: closed loops of calls on one client, for the fairness benchmarks.

Shared by `fairness` (the mock model) and `fairness_model` (the real one), which import this
module rather than each other.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from lmqueue.producer import QueueLM
from lmqueue.shared.settings import ClientSettings, RedisSettings

from .load import distinct_prompt

__all__ = ["Loop", "PROMPT_TOKENS", "fairness_client_settings"]

#: Prompt length of every call of a loop.
PROMPT_TOKENS = 8


@dataclass
class Loop:
    """A closed loop of calls on one client; latencies and completion times recorded
    (`time.monotonic`: comparable with another process's, see `loop_process`)."""

    lm: QueueLM
    concurrency: int
    salt: int
    done: list[tuple[float, float]] = field(default_factory=list)  # (finished at, latency)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stopping: bool = False

    def start(self) -> Loop:
        counter = iter(range(1 << 62))

        async def one() -> None:
            while not self._stopping:
                prompt = distinct_prompt(next(counter), self.salt, PROMPT_TOKENS)
                started = time.monotonic()
                await self.lm.next_token_logprobs(prompt)
                now = time.monotonic()
                self.done.append((now, now - started))

        self._tasks = [asyncio.create_task(one()) for _ in range(self.concurrency)]
        return self

    def between(self, start: float, end: float) -> list[float]:
        """Latencies of the calls that finished in [start, end)."""
        return [latency for at, latency in self.done if start <= at < end]

    async def stop(self) -> None:
        self._stopping = True
        await asyncio.gather(*self._tasks, return_exceptions=True)


def fairness_client_settings(redis_url: str) -> ClientSettings:
    """Every fairness client's settings: no caches (each call reaches the worker), float16
    rows, and room for a flood's calls in flight."""
    return ClientSettings(
        redis=RedisSettings(url=redis_url), wire_dtype="float16", use_shared_cache=False,
        local_cache_size=0, timeout_s=600, max_inflight=4096,
    )  # fmt: skip
