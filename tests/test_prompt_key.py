"""`PromptKey`: one spelling of a prompt's identity, and the Redis cache keys it spells."""

from __future__ import annotations

import types

import numpy as np
import pytest

from lmqueue.shared.adapters import AdapterRecord
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.prompt_key import PromptKey
from lmqueue.shared.shared_cache import SharedCache
from lmqueue.shared.wire import Request, decode_request, encode_request, ids_to_bytes

IDS = [1, 2, 49151]
TOKENS = ids_to_bytes(IDS)
DIGEST = "4224829d802f51735934e7d78142d576264cdb68"  # blake2b-160 of TOKENS
ADAPTERS = {
    "style": AdapterRecord("style", "/adapters/style", "abc123"),
    "mine": AdapterRecord("mine", "/adapters/mine", "def456", tenant="alice"),
}


def _cache(keys: KeySpace) -> SharedCache:
    cache = SharedCache(types.SimpleNamespace(mget=None), keys, "SmolLM2-135M", "rev1")
    cache.adapters = ADAPTERS
    return cache


def test_the_base_model_is_spelled_none_and_the_empty_name_is_refused():
    assert PromptKey.of_ids(IDS).adapter is None
    with pytest.raises(ValueError, match="None, not ''"):
        PromptKey("", TOKENS)


def test_keys_are_immutable_values_equal_by_adapter_and_tokens():
    key = PromptKey.of_ids(IDS, "style")
    assert key == PromptKey("style", bytes(TOKENS)) and hash(key) == hash(
        PromptKey("style", TOKENS)
    )
    assert (
        len({key, PromptKey.of_ids(IDS), PromptKey.of_ids(IDS, "mine"), PromptKey.of_ids([1])}) == 4
    )
    with pytest.raises(AttributeError):
        key.adapter = None  # type: ignore[misc]
    with pytest.raises(AttributeError):
        key.extra = 1  # type: ignore[attr-defined]


def test_any_integer_sequence_gives_the_key_its_request_travels_under():
    ids_key = PromptKey.of_ids(np.asarray(IDS, dtype=np.int64), "style")
    assert ids_key == PromptKey.of_ids(tuple(IDS), "style")
    request = Request("c:1", "c", TOKENS, adapter="style")
    decoded = decode_request({k.encode(): v for k, v in encode_request(request).items()})
    assert PromptKey.of_request(decoded) == ids_key
    assert PromptKey.of_request(Request("c:2", "c", TOKENS)) == PromptKey.of_ids(IDS)


def test_a_key_gives_back_its_ids_and_length():
    key = PromptKey.of_ids(IDS)
    assert key.ids() == IDS and all(type(i) is int for i in key.ids())
    assert key.token_count == 3


def test_keys_sort_base_first_then_by_adapter_then_by_tokens():
    keys = [PromptKey.of_ids(ids, adapter) for adapter in ("b", None, "a") for ids in ([2], [1])]
    assert [(k.adapter, k.ids()) for k in sorted(keys)] == [
        (None, [1]), (None, [2]), ("a", [1]), ("a", [2]), ("b", [1]), ("b", [2]),
    ]  # fmt: skip
    assert sorted(keys, key=PromptKey.order) == sorted(keys)


def test_the_plain_sort_key_orders_any_keys_as_the_keys_do() -> None:
    rng = np.random.default_rng(3)
    adapters = [None, "a", "ab", "b", "\u00e9"]
    keys = [
        PromptKey.of_ids(rng.integers(0, 70_000, size=rng.integers(1, 4)).tolist(), adapter)
        for adapter in adapters
        for _ in range(40)
    ]
    rng.shuffle(keys)
    assert sorted(keys, key=PromptKey.order) == sorted(keys)


def test_the_cache_key_spelling_is_the_one_existing_caches_hold():
    # Pinned against the format before `PromptKey` existed: caches filled by older workers and
    # clients must keep answering.
    own, pooled = (
        _cache(KeySpace(tenant="alice")),
        _cache(KeySpace().for_tenant("alice", "pool.lab")),
    )
    base, style, mine = (
        PromptKey(None, TOKENS),
        PromptKey("style", TOKENS),
        PromptKey("mine", TOKENS),
    )
    expected = [
        (own, base, "float32",
         f"lmq:alice:cache:SmolLM2-135M:rev1:lp.float32:{DIGEST}"),
        (own, style, "float16",
         f"lmq:alice:cache:SmolLM2-135M:rev1~style@abc123:lp.float16:{DIGEST}"),
        (own, mine, "bfloat16",
         f"lmq:alice:cache:SmolLM2-135M:rev1~mine@def456:lp.bfloat16:{DIGEST}"),
        (pooled, base, "float32",
         f"lmq:pool.lab:cache:SmolLM2-135M:rev1:lp.float32:{DIGEST}"),
        (pooled, style, "float16",
         f"lmq:pool.lab:cache:SmolLM2-135M:rev1~style@abc123:lp.float16:{DIGEST}"),
        (pooled, mine, "float16",  # a private adapter's rows never go to the pool
         f"lmq:alice:cache:SmolLM2-135M:rev1~mine@def456:lp.float16:{DIGEST}"),
    ]  # fmt: skip
    for cache, prompt, dtype, key in expected:
        assert cache.key_of(prompt, dtype) == key
        assert cache.key(dtype, prompt.tokens, prompt.adapter) == key  # the raw-fields spelling
    for dtype in ("float32", "float16", "float32"):  # the base model's prefix, once a dtype
        assert own.key_of(base, dtype) == f"lmq:alice:cache:SmolLM2-135M:rev1:lp.{dtype}:{DIGEST}"
    plain = SharedCache(types.SimpleNamespace(mget=None), KeySpace(), "m", "r")
    assert plain.key("float32", b"") == (
        "lmq:default:cache:m:r:lp.float32:3345524abf6bbe1809449224b5972c41790b6cf2"
    )


def test_a_cache_key_of_an_adapter_without_a_record_raises_key_error():
    with pytest.raises(KeyError):
        _cache(KeySpace()).key_of(PromptKey("unknown", TOKENS), "float32")
