"""``sample``: N ancestral samples of up to T tokens from a prompt, with a temperature.

Params: ``prompt`` (str), ``n`` (default 8), ``max_tokens`` (default 32), ``temperature``
(default 1.0; 0 is greedy), ``seed`` (default 0), ``batch_size`` (samples per checkpoint,
default 16). Sample i draws from its own generator seeded by ``(seed, i)``, so a sample is the
same whoever computes it and whenever (a resumed run redraws exactly the samples it lacks).
Rows: ``index``, ``tokens``, ``text``, ``logprob`` (the model's, untempered), ``eos``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from lmqueue.shared.errors import BadRequest

__all__ = ["run", "draw_samples"]


def _pick(logprobs: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    if temperature == 0:
        return int(np.argmax(logprobs))
    scaled = logprobs / temperature
    weights = np.exp(scaled - np.max(scaled))
    cdf = np.cumsum(weights)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(cdf) - 1))


async def draw_samples(
    lm: Any,
    prompt: Sequence[int],
    indices: Sequence[int],
    *,
    max_tokens: int,
    temperature: float,
    seed: int,
    eos_token_ids: Sequence[int],
) -> list[dict[str, Any]]:
    """Draw the samples numbered `indices`, all at once, one batched model call per step."""
    vocab_size = len(lm.byte_vocab)
    rngs = {i: np.random.default_rng([seed, i]) for i in indices}
    tokens: dict[int, list[int]] = {i: [] for i in indices}
    logprob = dict.fromkeys(indices, 0.0)
    live = [i for i in indices]
    eos: set[int] = set()
    for _ in range(max_tokens):
        if not live:
            break
        rows = await lm.batch_next_token_logprobs([list(prompt) + tokens[i] for i in live])
        still = []
        for i, row in zip(live, rows, strict=True):
            values = row[:vocab_size].double().numpy()
            token = _pick(values, temperature, rngs[i])
            logprob[i] += float(values[token])
            if token in eos_token_ids:
                eos.add(i)
                continue
            tokens[i].append(token)
            still.append(i)
        live = still
    return [
        {
            "index": i,
            "tokens": tokens[i],
            "text": lm.tokenizer.decode(tokens[i]),
            "logprob": logprob[i],
            "eos": i in eos,
        }
        for i in indices
    ]


async def run(ctx: Any, lm: Any, params: dict[str, Any]) -> None:
    """Draw ``n`` samples a batch at a time, checkpointing after each batch."""
    if lm is None:
        raise BadRequest("sample needs a model")
    prompt = lm.tokenizer.encode(str(params.get("prompt", "")), add_special_tokens=False)
    if not prompt:
        raise BadRequest("sample needs a non-empty prompt")
    n, batch_size = int(params.get("n", 8)), int(params.get("batch_size", 16))
    options: dict[str, Any] = {
        "max_tokens": int(params.get("max_tokens", 32)),
        "temperature": float(params.get("temperature", 1.0)),
        "seed": int(params.get("seed", 0)),
        "eos_token_ids": list(lm.info.eos_token_ids),
    }
    if n < 0 or batch_size <= 0 or options["max_tokens"] < 0 or options["temperature"] < 0:
        raise BadRequest("sample needs n >= 0, batch_size > 0, max_tokens >= 0, temperature >= 0")
    start = int(ctx.state.get("next", 0))
    ctx.report(start, n)
    for lo in range(start, n, batch_size):
        indices = list(range(lo, min(n, lo + batch_size)))
        rows = await draw_samples(lm, prompt, indices, **options)
        await ctx.checkpoint(rows, {"next": indices[-1] + 1}, done=indices[-1] + 1, total=n)
