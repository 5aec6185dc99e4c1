"""An adapter changing owner on the hf backend: what was computed for a private owner goes.

A worker keeps an adapter served while it is made public or private (`AdapterSet`). Rows and
KV computed while it was private to one tenant must not answer anyone else from the
backend's prefix cache (a faster answer would say what the owner asked): the adapter is
loaded again in place, which forgets them. Rows computed while it was public may stay.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lora_adapters import make_adapter

from lmqueue.shared.adapters import AdapterRecord, AdapterRegistry, adapter_revision
from lmqueue.shared.keys import KeySpace
from lmqueue.workers.adapter_set import AdapterSet
from lmqueue.workers.backends.hf import AsyncTransformer

KEYS = KeySpace()
MODEL = "tiny"
PROMPT = (1, 50, 60, 70)


async def test_an_adapter_that_stops_being_private_forgets_what_was_computed_for_its_owner(
    tiny_model_dir: Path, tmp_path: Path, aredis: Any
) -> None:
    path = make_adapter(tiny_model_dir, tmp_path / "a", seed=1)
    revision = adapter_revision(path)
    registry = AdapterRegistry(aredis, KEYS, MODEL)
    lm = AsyncTransformer.from_name(str(tiny_model_dir), timeout=0.05)
    adapters = AdapterSet(lm, aredis, KEYS, MODEL, {})

    async def owned_by(tenant: str | None) -> None:
        await registry.add(AdapterRecord("a", str(path), revision, tenant))
        await adapters.refresh()
        assert adapters.served["a"].tenant == tenant and lm.adapter_names == {"a"}

    try:
        await owned_by("acme")
        row = await lm.next_token_logprobs(list(PROMPT), "a")
        assert lm.cache.get(PROMPT, "a") is not None
        await owned_by(None)  # acme's rows are forgotten
        assert lm.cache.get(PROMPT, "a") is None
        again = await lm.next_token_logprobs(list(PROMPT), "a")
        assert (again - row).abs().max().item() <= 1e-5  # the same weights stay loaded
        await owned_by("globex")  # public rows may stay: any tenant could ask for them
        assert lm.cache.get(PROMPT, "a") is not None
        await owned_by("acme")  # from one tenant to another: globex's rows go
        assert lm.cache.get(PROMPT, "a") is None
    finally:
        await lm.aclose()
