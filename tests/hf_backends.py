"""Building `AsyncTransformer`s in a test and closing every one after it (one factory for the
hf backend's test files)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from lmqueue.workers.backends import AsyncTransformer


@contextlib.asynccontextmanager
async def backend_factory(
    model: Any, tokenizer: Any, vocab: dict[str, Any], **defaults: Any
) -> AsyncIterator[Callable[..., AsyncTransformer]]:
    """A `make(**options)` building backends over `model` (`defaults` under the options); every
    backend made is closed on exit."""
    built: list[AsyncTransformer] = []

    def make(**options: Any) -> AsyncTransformer:
        lm = AsyncTransformer(model, tokenizer, **vocab, **{**defaults, **options})
        built.append(lm)
        return lm

    try:
        yield make
    finally:
        for lm in built:
            await lm.aclose()
