"""``score``: the total and per-token log-probabilities of continuations given contexts.

Params: ``rows`` (a list of ``{"context": str, "continuation": str}``), ``batch_size`` (rows
per checkpoint, default 16). Context and continuation are tokenized separately (no special
tokens) and joined, so the continuation's tokens are the same whatever precedes them; an
empty context starts from the model's BOS token (or EOS when it has none). One row out per
row in, in order, with its ``index``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from lmqueue.shared.errors import BadRequest

__all__ = ["run", "score_row", "encode_pair"]


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of a context and a continuation (tokenized apart, no special tokens)."""
    ctx_ids = list(tokenizer.encode(context, add_special_tokens=False))
    cont_ids = list(tokenizer.encode(continuation, add_special_tokens=False))
    if not ctx_ids:
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else None
        start = start if start is not None else tokenizer.eos_token_id
        if start is None:
            raise BadRequest("an empty context needs a BOS or EOS token; the model has neither")
        ctx_ids = [start]
    if not cont_ids:
        raise BadRequest(f"empty continuation after context {context[:40]!r}")
    return ctx_ids, cont_ids


async def score_row(lm: Any, row: Mapping[str, Any]) -> dict[str, Any]:
    """Score one ``{context, continuation}`` row with `lm` (its calls run concurrently)."""
    if not isinstance(row.get("context"), str) or not isinstance(row.get("continuation"), str):
        raise BadRequest(f"a score row needs string context and continuation: {dict(row)!r}")
    ctx_ids, cont_ids = encode_pair(lm.tokenizer, row["context"], row["continuation"])
    vectors = await asyncio.gather(
        *(lm.next_token_logprobs(ctx_ids + cont_ids[:i]) for i in range(len(cont_ids)))
    )
    token_logprobs = [float(v[t]) for v, t in zip(vectors, cont_ids, strict=True)]
    return {
        "context": row["context"],
        "continuation": row["continuation"],
        "tokens": cont_ids,
        "token_logprobs": token_logprobs,
        "logprob": sum(token_logprobs),
    }


async def run(ctx: Any, lm: Any, params: dict[str, Any]) -> None:
    """Score every row, a batch at a time, checkpointing after each batch."""
    rows: Sequence[Mapping[str, Any]] = params.get("rows") or []
    batch_size = int(params.get("batch_size", 16))
    if lm is None:
        raise BadRequest("score needs a model")
    if batch_size <= 0:
        raise BadRequest(f"batch_size={batch_size}: must be > 0")
    start = int(ctx.state.get("next", 0))
    ctx.report(start, len(rows))
    for lo in range(start, len(rows), batch_size):
        batch = rows[lo : lo + batch_size]
        scored = await asyncio.gather(*(score_row(lm, row) for row in batch))
        out = [{"index": lo + i, **result} for i, result in enumerate(scored)]
        end = lo + len(batch)
        await ctx.checkpoint(out, {"next": end}, done=end, total=len(rows))
