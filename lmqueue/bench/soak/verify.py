"""Were the answers right? Sampled rows checked against the model run in this process.

The reference is the hf backend itself, in-process, with the same adapters loaded, computing
each sampled prompt from scratch (``next_token_logprobs_uncached``: no KV reuse, no batch).
A sampled SMC row is right when its values at the recorded token ids are within `TOLERANCE`
of the reference's and its argmax is the reference's (unless the reference's top two are
closer than that); a scored experiment row when each token's log-probability is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = ["Verdict", "verify", "TOLERANCE"]

#: float32 rows through batched, KV-reusing forwards against one plain forward (the tests' bound)
TOLERANCE = 1e-4


@dataclass
class Verdict:
    """How many sampled rows were checked, and which were wrong."""

    checked: int = 0
    wrong: int = 0
    max_abs_diff: float = 0.0
    examples: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able copy."""
        return asdict(self)

    def note(self, diff: float, right: bool, what: dict[str, Any]) -> None:
        """Count one checked row."""
        self.checked += 1
        self.max_abs_diff = max(self.max_abs_diff, diff)
        if not right:
            self.wrong += 1
            if len(self.examples) < 5:
                self.examples.append({**what, "diff": diff})


def _spread(items: Sequence[Any], limit: int) -> list[Any]:
    """At most `limit` items, evenly spaced over the run."""
    if len(items) <= limit:
        return list(items)
    step = len(items) / limit
    return [items[int(i * step)] for i in range(limit)]


def verify(
    model_dir: str,
    adapters: Mapping[str, str],
    samples: Sequence[dict[str, Any]],
    scored: Sequence[dict[str, Any]],
    limit: int = 800,
) -> dict[str, Verdict]:
    """Check `samples` (journal rows) and `scored` (experiment rows), at most `limit` of each."""
    import asyncio

    return asyncio.run(_verify(model_dir, adapters, samples, scored, limit))


async def _verify(
    model_dir: str,
    adapters: Mapping[str, str],
    samples: Sequence[dict[str, Any]],
    scored: Sequence[dict[str, Any]],
    limit: int,
) -> dict[str, Verdict]:
    from lmqueue.scheduler.kinds.score import encode_pair
    from lmqueue.workers.backends.hf import AsyncTransformer

    lm = AsyncTransformer.from_name(model_dir)
    try:
        for name, path in adapters.items():
            await lm.load_adapter(name, path)

        def row(prompt: list[int], adapter: str | None) -> np.ndarray:
            out = lm.next_token_logprobs_uncached(prompt, adapter)
            return np.asarray(out, dtype=np.float64)

        programs = Verdict()
        for sample in _spread(samples, limit):
            expected = row(sample["p"], sample["a"])
            diff = float(np.max(np.abs(expected[sample["i"]] - np.asarray(sample["v"]))))
            top2 = np.sort(expected)[-2:]
            argmax_ok = sample["am"] == int(np.argmax(expected)) or top2[1] - top2[0] < TOLERANCE
            programs.note(diff, diff <= TOLERANCE and argmax_ok, {"prompt": sample["p"][-4:]})
        experiments = Verdict()
        for scored_row in _spread(scored, limit // 4):
            ctx, cont = encode_pair(lm.tokenizer, scored_row["context"], scored_row["continuation"])
            got = scored_row["token_logprobs"]
            diffs = [
                abs(row(ctx + cont[:i], None)[token] - value)
                for i, (token, value) in enumerate(zip(cont, got, strict=True))
            ]
            right = cont == scored_row["tokens"] and max(diffs) <= TOLERANCE
            experiments.note(max(diffs), right, {"context": scored_row["context"]})
        return {"programs": programs, "experiments": experiments}
    finally:
        await lm.aclose()
