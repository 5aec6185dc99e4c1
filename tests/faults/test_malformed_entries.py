"""Garbage in the request stream: every entry is answered or parked, and the worker serves on."""

from __future__ import annotations

import asyncio
import random

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from lmqueue.shared.errors import MalformedMessage, OversizeRequest
from lmqueue.shared.wire import Request, decode_reply, encode_request, ids_to_bytes, payload_bytes
from lmqueue.workers.processor import BatchProcessor
from lmqueue.workers.request_stream import Entry

from .harness import KEYS, MODEL, Load, assert_clean, connect, make_prompts, probe, settled_streams

FAKE_CLIENT = "fuzzclient"


def _valid_envelope(n: int) -> bytes:
    request = Request(f"{FAKE_CLIENT}:{n}", FAKE_CLIENT, ids_to_bytes([1, 2, n % 1000]))
    return encode_request(request)["m"]


def _mutated(rng: random.Random, n: int) -> dict[bytes, bytes]:
    """A valid envelope with bytes flipped, cut or spliced: anything may come of it."""
    raw = bytearray(_valid_envelope(n))
    for _ in range(rng.randint(1, 4)):
        position = rng.randrange(len(raw))
        choice = rng.random()
        if choice < 0.5:
            raw[position] ^= 1 << rng.randrange(8)
        elif choice < 0.75:
            del raw[position:]
            raw += rng.randbytes(rng.randint(0, 8))
        else:
            raw[position:position] = rng.randbytes(rng.randint(1, 8))
    return {b"m": bytes(raw)}


def garbage(rng: random.Random, count: int) -> list[tuple[str, dict[bytes, bytes]]]:
    """(kind, fields) of `count` bad entries, a mix of every kind of defect."""
    makers = {
        "random bytes": lambda n: {b"m": rng.randbytes(rng.randint(0, 64))},
        "no envelope field": lambda n: {b"x": b"1"},
        "mutated envelope": lambda n: _mutated(rng, n),
        "wrong field types": lambda n: {b"m": msgpack.packb(
            {"v": 1, "id": f"{FAKE_CLIENT}:{n}", "client": FAKE_CLIENT, "kind": "logprobs",
             "tokens": "not bytes", "dtype": "float32", "deadline_ms": 0})},
        "unsafe client name": lambda n: {b"m": msgpack.packb(
            {"v": 1, "id": "x", "client": "../../etc", "kind": "logprobs"})},
        "oversized (1.5 MB)": lambda n: {b"m": _valid_envelope(n),
                                         b"pad": rng.randbytes(1_500_000)},
    }  # fmt: skip
    kinds = list(makers)
    return [(kinds[n % len(kinds)], makers[kinds[n % len(kinds)]](n)) for n in range(count)]


async def test_garbage_entries_are_answered_or_parked_and_the_worker_keeps_serving(
    fault_redis, workers, reference, record
):
    (worker,) = workers.spawn(fault_redis.url, 1, backend_opts={"batch_delay_s": 0.01})
    bad = garbage(random.Random(9), 300)
    async with connect(fault_redis.url) as lm, probe(fault_redis.url) as redis:
        load = Load(lm, make_prompts(300, seed=9))
        running = asyncio.create_task(load.run("300 garbage entries among 300 requests"))
        for _, fields in bad:
            await redis.xadd(KEYS.requests(MODEL), fields)
            await asyncio.sleep(0)
        figures = load.check(await running, reference)
        left = await settled_streams(redis)
        replies = await _replies_to_others(redis, lm.client_id)
        after = await lm.next_token_logprobs([5, 4, 3, 2, 1])  # still serving
    fake = [r for r in replies if r.request_id.startswith(FAKE_CLIENT)]
    oversized = sum(isinstance(r.error, OversizeRequest) for r in fake)
    figures.extra.update(
        garbage=len(bad), garbage_replied=len(replies), garbage_dead_lettered=left["dead_letters"],
        oversize_errors=oversized,
        malformed_errors=sum(isinstance(r.error, MalformedMessage) for r in fake),
    )  # fmt: skip
    record(figures)
    assert_clean(figures)
    assert len(replies) + left["dead_letters"] == len(bad)  # each exactly once, nothing lost
    assert oversized == sum(kind.startswith("oversized") for kind, _ in bad)
    assert worker.alive and after.shape == (49152,)


async def _replies_to_others(redis, own_client: str) -> list:
    """Every reply written to a reply stream other than `own_client`'s."""
    replies = []
    async for key in redis.scan_iter(match=KEYS.replies("*")):
        if key.decode() != KEYS.replies(own_client):
            replies += [decode_reply(fields) for _, fields in await redis.xrange(key)]
    return replies


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.binary(max_size=80).map(lambda raw: {b"m": raw}),
            st.tuples(st.integers(0, 10**6), st.binary(max_size=8), st.integers(0, 200)).map(
                lambda t: {b"m": _splice(_valid_envelope(t[0]), t[1], t[2])}
            ),
            st.dictionaries(st.binary(max_size=3), st.binary(max_size=16), max_size=3),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_fuzzed_batches_end_in_one_reply_or_dead_letter_per_entry(reference, batch):
    processor = BatchProcessor(reference, cache=None)
    entries = [Entry(f"1-{n}", fields) for n, fields in enumerate(batch)]
    outcome = asyncio.run(processor.process(entries))
    assert sorted(outcome.acks) == sorted(entry.entry_id for entry in entries)
    assert len(outcome.replies) + len(outcome.dead) == len(entries)
    for _, fields in outcome.replies:  # as written: deferred payloads made into bytes
        decode_reply({key.encode(): payload_bytes(value) for key, value in fields.items()})


def _splice(raw: bytes, insert: bytes, at: int) -> bytes:
    """`raw` with `insert` written over it at `at` (clamped): a corrupted but plausible envelope."""
    at = min(at, len(raw))
    return raw[:at] + insert + raw[at + len(insert) :]
