"""16-bit wire dtypes: torch's fast conversions give numpy's (float16) or torch's own
(bfloat16) results, bit for bit, and callers always get float32."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
import torch

from lmqueue.producer.tensors import to_float32_tensor, widened
from lmqueue.shared.wire import (
    DeferredPayload,
    Reply,
    bytes_to_vector,
    vector_payload,
    vector_to_bytes,
)


def _awkward_float32s() -> np.ndarray:
    """Values where rounding to float16 is hard: ties, subnormals, overflow, infinities."""
    rng = np.random.default_rng(0)
    every_half = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    finite = every_half[np.isfinite(every_half)].astype(np.float32)
    with np.errstate(over="ignore"):  # the spacing above 65504 is infinite
        ulp = np.spacing(finite.astype(np.float16)).astype(np.float32)
    ties = finite + ulp / 2  # exactly half-way: round to even
    near = np.concatenate([finite + ulp * f for f in (0.25, 0.49, 0.51, 0.75, -0.5)])
    randoms = np.concatenate(
        [
            (rng.standard_normal(100_000) * 10).astype(np.float32),
            rng.uniform(-70_000, 70_000, 10_000).astype(np.float32),  # past float16's range
            (rng.standard_normal(10_000) * 1e-6).astype(np.float32),  # float16 subnormals
        ]
    )
    specials = np.array([0.0, -0.0, np.inf, -np.inf, 65504, 65519.99, 65520, 6e-8, 2e-8, 3e-8])
    values = np.concatenate([finite, ties, near, randoms, specials.astype(np.float32)])
    return values[np.isfinite(values) | np.isinf(values)].astype(np.float32)


def test_encoding_float32_to_float16_matches_numpy_bit_for_bit():
    values = _awkward_float32s()
    with np.errstate(over="ignore"):  # numpy warns where values overflow to infinity
        expected = values.astype("<f2").view("<u2")
    for vector in (values, torch.from_numpy(values.copy())):
        got = np.frombuffer(vector_payload(vector, "float16"), dtype="<u2")
        np.testing.assert_array_equal(got, expected)
    assert vector_to_bytes(values, "float16") == expected.tobytes()


def test_encoding_keeps_nans_nan():
    values = np.array([np.nan, -np.nan, 1.0], dtype=np.float32)
    decoded = bytes_to_vector(vector_payload(values, "float16"), "float16")
    assert np.isnan(decoded[:2]).all() and decoded[2] == 1.0


def test_decoding_float16_to_float32_matches_numpy_bit_for_bit():
    every_half = np.arange(1 << 16, dtype=np.uint16).view("<f2")
    raw = every_half.tobytes()
    tensor = to_float32_tensor(bytes_to_vector(raw, "float16"))
    assert tensor.dtype == torch.float32 and tensor.is_contiguous()
    expected = every_half.astype(np.float32)
    finite_or_inf = ~np.isnan(expected)
    np.testing.assert_array_equal(
        tensor.numpy().view("<u4")[finite_or_inf], expected.view("<u4")[finite_or_inf]
    )
    assert np.isnan(tensor.numpy()[~finite_or_inf]).all()


def test_decoded_tensors_are_writable_copies():
    raw = np.arange(40_000, dtype=np.float32).astype("<f2").tobytes()
    tensor = to_float32_tensor(bytes_to_vector(raw, "float16"))
    tensor.add_(1)  # would corrupt the wire payload if it were a view
    assert bytes_to_vector(raw, "float16")[1] == 1.0


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_other_dtypes_are_viewed_or_cast_like_numpy(dtype):
    vector = np.linspace(-30, 0, 50_000, dtype=np.float32)
    payload = vector_payload(vector, dtype)
    assert bytes(payload) == vector.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    if dtype == "float32":
        assert np.shares_memory(np.frombuffer(payload, dtype="<f4"), vector)


def test_a_read_only_float32_array_still_encodes_to_float16():
    vector = np.frombuffer(np.linspace(-5, 0, 1000, dtype=np.float32).tobytes(), dtype="<f4")
    assert not vector.flags.writeable
    assert bytes(vector_payload(vector, "float16")) == vector.astype("<f2").tobytes()


def test_bfloat16_keeps_torchs_rounding_and_widens_back_exactly():
    values = torch.from_numpy(_awkward_float32s())
    payload = vector_payload(values, "bfloat16")
    expected = values.to(torch.bfloat16)
    assert bytes(payload) == expected.view(torch.int16).numpy().tobytes()
    assert bytes(vector_payload(values.numpy(), "bfloat16")) == bytes(payload)  # numpy input
    wide = widened(Reply("c:1", payload, "bfloat16"))
    assert wide.dtype == "float32"
    got = np.frombuffer(wide.payload, dtype=np.float32)
    want = expected.float().numpy()
    same = np.isnan(want) == np.isnan(got)
    assert same.all() and np.array_equal(got[~np.isnan(want)], want[~np.isnan(want)])
    assert got.flags.writeable  # a vector of its own, for the caller to take over


def test_a_mock_converts_each_shared_vector_once_to_the_bytes_any_backend_sends(smol_tokenizer):
    from lmqueue.workers.backends.mock import MockAsyncLM

    backend = MockAsyncLM(smol_tokenizer, distinct_vectors=2)
    shared = backend.logprobs_of([1, 2, 3])
    for dtype in ("float16", "bfloat16", "float64"):
        first = backend.wire_payload(shared, dtype)
        assert bytes(first) == bytes(vector_payload(shared, dtype))
        assert backend.wire_payload(shared, dtype) is first  # made once, then handed out
        assert first.readonly  # shared by every reply that carries it
    assert bytes(backend.wire_payload(shared, "float32")) == shared.numpy().tobytes()
    own = shared.clone()  # equal values, not the shared vector: converted on the writer thread
    assert isinstance(backend.wire_payload(own, "float16"), DeferredPayload)
    assert isinstance(MockAsyncLM(smol_tokenizer).wire_payload(shared, "float16"), DeferredPayload)


def test_a_mock_picks_each_prompt_s_shared_vector_alike_in_every_process(smol_tokenizer):
    """Workers and a test's own mock must agree on a prompt's vector: the pick is a tuple's
    hash, which no ``PYTHONHASHSEED`` changes."""
    import subprocess
    import sys

    from lmqueue.workers.backends.mock import MockAsyncLM

    prompts = [[4, 4, n] for n in range(40)] + [[1], [49151, 0, 7]]
    backend = MockAsyncLM(smol_tokenizer, distinct_vectors=8)
    here = [backend._vector_index[id(backend.logprobs_of(p))] for p in prompts]
    assert len(set(here)) >= 4  # prompts spread over the vectors
    code = (
        "from lmqueue.workers.backends.mock import MockAsyncLM\n"
        "from lmqueue.workers.models import load_tokenizer\n"
        "b = MockAsyncLM(load_tokenizer('smollm2-135m'), distinct_vectors=8)\n"
        f"print([b._vector_index[id(b.logprobs_of(p))] for p in {prompts!r}])"
    )
    for seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=120, check=True)  # fmt: skip
        assert done.stdout.strip() == str(here)


@pytest.mark.parametrize("distinct_vectors", [0, 2])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
async def test_16_bit_replies_reach_callers_as_float32_through_every_read_path(
    smol_tokenizer, redis_url, dtype, distinct_vectors
):
    from lmqueue.producer import QueueLM
    from lmqueue.shared.connections import async_redis
    from lmqueue.shared.settings import RedisSettings, WorkerSettings
    from lmqueue.workers.backends.mock import MockAsyncLM
    from lmqueue.workers.worker import Worker

    backend = MockAsyncLM(smol_tokenizer, distinct_vectors=distinct_vectors)
    settings = WorkerSettings(
        model="mock", backend="mock", name="half-worker", redis=RedisSettings(url=redis_url)
    )
    redis = async_redis(redis_url)
    worker = Worker(settings, backend, redis)
    await worker.publish()
    stop = asyncio.Event()
    serving = asyncio.create_task(worker.serve(stop))
    prompts = [[4, 4, n] for n in range(6)]
    try:
        async with await QueueLM.connect("mock", redis_url=redis_url, wire_dtype=dtype) as lm:
            threaded = await lm.batch_next_token_logprobs(prompts[:3])
            resolved = lm.stats["claims_resolved"]
        async with await QueueLM.connect("mock", redis_url=redis_url, wire_dtype=dtype) as lm:
            lm.channel.reader.thread = None  # on the event loop, as on a cluster or over TLS
            looped = await lm.batch_next_token_logprobs(prompts[3:])
            resolved += lm.stats["claims_resolved"]
    finally:
        stop.set()
        await serving
        await redis.aclose()
    rows = torch.stack([backend.logprobs_of(p) for p in prompts])
    want = rows.to(torch.bfloat16 if dtype == "bfloat16" else torch.float16).float()
    got = torch.cat([threaded, looped])
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert resolved == len(prompts)
