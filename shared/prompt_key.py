"""`PromptKey`: what one computation is: the LoRA adapter it runs under and the prompt's tokens.

Every layer that de-duplicates, caches or addresses a prompt keys it with this one type: the
client's local LRU and in-flight table (`producer`), the worker's batch de-duplication
(`workers.processor`) and the shared cache's Redis keys (`cache_key`, laid out by
`shared.keys.KeySpace.cache_entry`). The base model is spelled ``None``, never ``""`` (the
constructor refuses ``""``); the tokens are the prompt's little-endian int32 bytes, exactly as
they travel in a request (`shared.wire`). A key is built once, where a request enters a process
(`of_ids` on the client, `of_request` on the worker), and travels with it.

The backends stand behind the `AsyncLM` interface, which speaks token ids (`ids`): their own
queues and prefix tries key on the adapter and the ids, with the same ``None`` for the base.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from .wire import bytes_to_ids, ids_to_bytes

if TYPE_CHECKING:
    from .adapters import AdapterRecord
    from .keys import KeySpace
    from .wire import Request

__all__ = ["PromptKey"]


class _Fields(NamedTuple):
    adapter: str | None
    tokens: bytes


class PromptKey(_Fields):
    """A prompt's identity: its adapter (None: the base model) and its int32 token bytes.

    Immutable and hashable. A tuple underneath, so that the dicts of the hot paths hash and
    compare keys in C (a dataclass's Python ``__hash__`` and ``__eq__`` cost about 1 us more per
    request on each side); compare keys with keys, not with bare tuples. Sorted, base-model
    keys come first, then by adapter name, then by tokens.

    Raises:
        ValueError: for the adapter ``""`` (the base model is ``None``).
    """

    __slots__ = ()

    def __new__(cls, adapter: str | None, tokens: bytes) -> PromptKey:
        if adapter == "":
            raise ValueError("the base model's adapter is None, not ''")
        return tuple.__new__(cls, (adapter, tokens))

    @classmethod
    def of_ids(cls, ids: Any, adapter: str | None = None) -> PromptKey:
        """The key of token ids (a sequence of ints or an integer array) under `adapter`."""
        return cls(adapter, ids_to_bytes(ids))

    @classmethod
    def of_request(cls, request: Request) -> PromptKey:
        """The key of a request's wire fields: its token bytes and its adapter."""
        return cls(request.adapter, request.token_bytes)

    @property
    def token_count(self) -> int:
        """How many tokens the prompt has."""
        return len(self.tokens) // 4

    def ids(self) -> list[int]:
        """The prompt's token ids, as the `AsyncLM` interface takes them."""
        ids: list[int] = bytes_to_ids(self.tokens).tolist()
        return ids

    def cache_key(
        self,
        keys: KeySpace,
        model: str,
        revision: str,
        kind: str,
        adapters: Mapping[str, AdapterRecord],
    ) -> str:
        """The shared-cache key of this prompt's result of `kind` (``lp.float32``, ...).

        An adapter's rows carry its name and revision (its record in `adapters`), and a
        private adapter's rows stay in its tenant's own namespace.

        Raises:
            KeyError: the adapter has no record in `adapters` (callers check names first).
        """
        if self.adapter is None:
            return keys.cache_entry(model, revision, kind, self.tokens)
        record = adapters[self.adapter]
        return keys.cache_entry(
            model, revision, kind, self.tokens,
            adapter_tag=record.cache_tag(), own_namespace=record.tenant is not None,
        )  # fmt: skip

    def order(self) -> tuple[bool, str, bytes]:
        """A plain tuple that sorts as keys do (``sorted(keys, key=PromptKey.order)``): compared
        in C, where sorting keys themselves calls `__lt__` in Python n log n times (a batch of
        32 prompts: ~150 calls, a few us a request on the worker's loop)."""
        adapter = self.adapter
        return (adapter is not None, adapter or "", self.tokens)

    def __lt__(self, other: tuple[Any, ...]) -> bool:
        adapter, tokens = other
        if self.adapter == adapter:
            return self.tokens < tokens
        if self.adapter is None or adapter is None:
            return self.adapter is None
        return bool(self.adapter < adapter)
