"""Custom experiment kinds the scheduler tests register (``--kind exp_kinds:count``)."""

from __future__ import annotations

import asyncio
from typing import Any


async def count(ctx: Any, lm: Any, params: dict[str, Any]) -> None:
    """Write rows 0..n-1, one per `delay_s`, checkpointing each (no model needed)."""
    n, delay_s = int(params.get("n", 10)), float(params.get("delay_s", 0.1))
    start = int(ctx.state.get("next", 0))
    ctx.report(start, n)
    for i in range(start, n):
        await asyncio.sleep(delay_s)
        await ctx.checkpoint([{"index": i}], {"next": i + 1}, done=i + 1, total=n)


async def echo(ctx: Any, lm: Any, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Return the params as one row, with the tenant and the model's vocabulary size."""
    return [{"tenant": ctx.tenant, "params": params, "vocab": len(lm.byte_vocab) if lm else 0}]


async def slow_model(ctx: Any, lm: Any, params: dict[str, Any]) -> None:
    """Call the model `width` prompts at a time until cancelled; note the calls then pending
    (awaited, unanswered) and the client's in-flight requests after the cancellation."""
    width, step = int(params.get("width", 16)), 0

    async def call(prompt: list[int]) -> None:
        await lm.next_token_logprobs(prompt)

    calls: list[asyncio.Task[None]] = []
    try:
        while True:
            calls = [asyncio.ensure_future(call([1 + step, 2 + j])) for j in range(width)]
            await asyncio.gather(*calls)
            step += 1
            ctx.report(step)
    except asyncio.CancelledError:
        await asyncio.gather(*calls, return_exceptions=True)
        at_cancel = sum(task.cancelled() for task in calls)  # awaited, unanswered, cancelled
        record = ctx.keys.experiment_record(ctx.id)
        mapping = {"pending_at_cancel": at_cancel, "inflight_after_cancel": lm.stats["inflight"]}
        await ctx.redis.hset(record, mapping=mapping)
        raise
