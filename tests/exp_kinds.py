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
