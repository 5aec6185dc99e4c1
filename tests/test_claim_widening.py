"""float16 claimed vectors widened as they arrive (`HalfWidener`), and where they are not.

The reply thread receives a read's claimed float16 vectors into one reused buffer and widens
each into its float32 array at once (issue 33: cheaper than widening them all after the read).
The values must be exactly `widened`'s, and nothing but a float16 claim may take that path.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import redis

from lmqueue.producer import tensors
from lmqueue.producer.claims import ClaimResolver
from lmqueue.producer.reply_thread import ReplyThread
from lmqueue.producer.tensors import HalfWidener, WideHalf, widened
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.resp_socket import target_of_url
from lmqueue.shared.wire import Reply, encode_claim

SIZE = 4096  # values a vector holds


def _halves(seed: int) -> np.ndarray:
    """float16 values with every kind of edge: subnormals, infinities, NaN, signed zeros."""
    values = np.random.default_rng(seed).standard_normal(SIZE).astype(np.float16)
    values[:6] = [np.float16(6e-8), -np.inf, np.inf, np.nan, -0.0, 65504]
    return values


@pytest.mark.parametrize("with_torch", [True, False])
def test_a_vector_widens_as_widened_widens_it(monkeypatch, with_torch: bool) -> None:
    if not with_torch:  # a numpy-only program: numpy's conversion
        monkeypatch.setattr(tensors, "imported_torch", lambda: None)
    widener = HalfWidener(SIZE)
    made = []
    for seed in range(3):  # one scratch, reused: each result is its own
        half = _halves(seed)
        widener.scratch[:] = half.data.cast("B")
        made.append((half, widener()))
    for half, result in made:
        expected = widened(Reply("r", half.data.cast("B"), "float16")).payload
        assert isinstance(result, WideHalf)
        assert bytes(result.payload) == bytes(expected)
        assert not result.payload.readonly


def test_only_a_float16_claim_of_the_vector_s_size_takes_a_widened_value() -> None:
    resolver = ClaimResolver(None, vector_size=SIZE)
    right = WideHalf(np.zeros(SIZE, np.float32).data.cast("B"))
    short = WideHalf(np.zeros(SIZE - 1, np.float32).data.cast("B"))
    claims = [
        Reply("half", dtype="float16", claim="k1", cached=True),
        Reply("single", dtype="float32", claim="k2"),
        Reply("short", dtype="float16", claim="k3"),
    ]
    found, missed = resolver.match(claims, [right, right, short])
    assert [(r.request_id, r.dtype, r.cached) for r in found] == [("half", "float32", True)]
    assert found[0].payload is right.payload
    assert [r.request_id for r in missed] == ["single", "short"]


@pytest.fixture
def thread(redis_url: str) -> Iterator[ReplyThread]:
    target = target_of_url(redis_url)
    made = ReplyThread(target, target, ClaimResolver(None, 5.0, vector_size=SIZE))
    yield made
    made.close()


async def _read(thread: ReplyThread, stream: str) -> Any:
    return await thread.read(stream, "0-0", None, False, 100, 100)


async def test_claimed_float16_vectors_reach_the_loop_widened(redis_url, thread) -> None:
    admin = redis.Redis.from_url(redis_url)
    stream = KeySpace().replies("widen")
    halves = [_halves(seed) for seed in range(5)]
    for i, half in enumerate(halves):
        admin.set(f"h{i}", half.tobytes())
        admin.xadd(stream, encode_claim(f"r{i}", f"h{i}", "float16"))
    admin.xadd(stream, encode_claim("gone", "nothing", "float16"))
    batch = await _read(thread, stream)
    assert [r.request_id for r in batch.ready] == [f"r{i}" for i in range(5)]
    for half, reply in zip(halves, batch.ready, strict=True):
        assert reply.dtype == "float32"
        assert bytes(reply.payload) == half.astype(np.float32).tobytes()
    assert [r.request_id for r in batch.missed] == ["gone"]


async def test_a_read_that_mixes_dtypes_keeps_each_claim_to_its_own(redis_url, thread) -> None:
    """With a float32 claim among them, nothing is widened as it arrives: a float32 value of
    a float16 vector's length is a miss, never taken for a float16 vector."""
    admin = redis.Redis.from_url(redis_url)
    stream = KeySpace().replies("mixed")
    half, single = _halves(1), np.arange(SIZE, dtype="<f4")
    admin.mset({"h": half.tobytes(), "s": single.tobytes(), "wrong": half.tobytes()})
    admin.xadd(stream, encode_claim("half", "h", "float16"))
    admin.xadd(stream, encode_claim("single", "s", "float32"))
    admin.xadd(stream, encode_claim("wrong", "wrong", "float32"))
    batch = await _read(thread, stream)
    ready = {r.request_id: r for r in batch.ready}
    assert sorted(ready) == ["half", "single"]
    assert bytes(ready["half"].payload) == half.astype(np.float32).tobytes()
    assert bytes(ready["single"].payload) == single.tobytes()
    assert [r.request_id for r in batch.missed] == ["wrong"]


async def test_a_client_keeping_half_results_gets_the_float16_bytes(redis_url) -> None:
    target = target_of_url(redis_url)
    thread = ReplyThread(
        target, target, ClaimResolver(None, 5.0, vector_size=SIZE), keep_float16=True
    )
    admin = redis.Redis.from_url(redis_url)
    stream = KeySpace().replies("kept")
    half = _halves(2)
    admin.set("h", half.tobytes())
    admin.xadd(stream, encode_claim("r", "h", "float16"))
    try:
        batch = await _read(thread, stream)
    finally:
        thread.close()
    (reply,) = batch.ready
    assert reply.dtype == "float16" and bytes(reply.payload) == half.tobytes()
