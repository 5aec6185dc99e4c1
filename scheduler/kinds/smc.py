"""``smc``: constrained sequential Monte Carlo with P particles (`scheduler.smc_sampler`).

Params: ``prompt`` (str), ``particles`` (default 16), ``steps`` (default 16), ``seed``
(default 0), and one constraint: ``lipogram`` (a string of banned characters, e.g. ``"eE"``:
no token may contain them) or ``regex`` (a pattern the generated text must stay a prefix of a
match of, checked through the token-character trie). Rows: one per final particle, with
``index``, ``tokens``, ``text``, ``log_weight`` (null for weight zero: the constraint left the
particle no token, as JSON has no -Infinity) and ``done``.

The run is a whole: it writes its rows once at the end, so a retried run starts over (seeded,
so it reproduces the same particles); progress is the step.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from lmqueue.shared.errors import BadRequest
from lmqueue.shared.lm.trie import TokenCharacterTrie

from ..smc_sampler import lipogram_mask, run_smc
from .regex_constraint import RegexConstraint

__all__ = ["run", "constraint_masks"]


def _trie_with_edges(byte_vocab: list[bytes]) -> TokenCharacterTrie:
    trie = TokenCharacterTrie(byte_vocab)
    trie.children  # noqa: B018 - built here, off the event loop, not on the first mask
    return trie


async def constraint_masks(
    params: dict[str, Any], byte_vocab: list[bytes], eos_token_ids: list[int]
) -> dict[str, Any]:
    """`run_smc`'s ``allowed``/``allowed_for`` arguments for the params' constraint."""
    if "lipogram" in params and "regex" in params:
        raise BadRequest("smc takes one constraint: lipogram or regex")
    if "lipogram" in params:
        banned = str(params["lipogram"]).encode()
        return {"allowed": await asyncio.to_thread(lipogram_mask, byte_vocab, banned)}
    if "regex" in params:
        trie = await asyncio.to_thread(_trie_with_edges, byte_vocab)
        try:
            constraint = RegexConstraint(str(params["regex"]), trie, eos_token_ids)
        except Exception as exc:  # the regex module's error type
            raise BadRequest(f"regex {params['regex']!r}: {exc}") from None
        return {"allowed_for": constraint.allowed_for}
    return {}


async def run(ctx: Any, lm: Any, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Run the sampler; its final particles."""
    if lm is None:
        raise BadRequest("smc needs a model")
    prompt = lm.tokenizer.encode(str(params.get("prompt", "")), add_special_tokens=False)
    n_particles, n_steps = int(params.get("particles", 16)), int(params.get("steps", 16))
    if not prompt or n_particles <= 0 or n_steps <= 0:
        raise BadRequest("smc needs a non-empty prompt, particles > 0 and steps > 0")
    byte_vocab = [bytes(token) for token in lm.byte_vocab]
    eos = list(lm.info.eos_token_ids)
    masks = await constraint_masks(params, byte_vocab, eos)
    ctx.report(0, n_steps)
    result = await run_smc(
        lm,
        prompt,
        n_particles,
        n_steps,
        eos_token_ids=eos,
        seed=int(params.get("seed", 0)),
        on_step=lambda step: ctx.report(step + 1, n_steps),
        **masks,
    )
    return [
        {
            "index": i,
            "tokens": p.tokens,
            "text": lm.tokenizer.decode(p.tokens),
            "log_weight": p.log_weight if math.isfinite(p.log_weight) else None,
            "done": p.done,
        }
        for i, p in enumerate(result.particles)
    ]
