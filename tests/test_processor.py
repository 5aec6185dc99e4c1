"""BatchProcessor: admission, dedup, poison isolation, without Redis (cache off)."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lmqueue.shared.errors import (
    BadRequest,
    DeadlineExceeded,
    EmptyPrompt,
    LMQueueError,
    MalformedMessage,
    ModelError,
    OversizeRequest,
    PromptTooLong,
    TokenOutOfVocabulary,
)
from lmqueue.shared.lm.validation import check_token_bytes
from lmqueue.shared.wire import Request, decode_reply, encode_request, ids_to_bytes, payload_bytes
from lmqueue.workers.backends.mock import MockAsyncLM
from lmqueue.workers.processor import BatchProcessor
from lmqueue.workers.request_stream import Entry

POISON = 666


@pytest.fixture
def backend(smol_tokenizer):
    return MockAsyncLM(smol_tokenizer, poison_token=POISON)


def _entry(n: int, tokens: list[int], **fields) -> Entry:
    request = Request(f"c:{n}", "c", ids_to_bytes(tokens), **fields)
    return Entry(f"1-{n}", {k.encode(): v for k, v in encode_request(request).items()})


def _replies(outcome):
    """Replies as written (deferred payloads made into bytes, as the writer does)."""
    decoded = [
        decode_reply({k.encode(): payload_bytes(v) for k, v in fields.items()})
        for _, fields in outcome.replies
    ]
    return {reply.request_id: reply for reply in decoded}


async def test_each_request_gets_one_reply_and_every_entry_is_acked(backend):
    processor = BatchProcessor(backend, cache=None)
    entries = [_entry(i, [1, 2, i]) for i in range(10)]
    outcome = await processor.process(entries)
    replies = _replies(outcome)
    assert sorted(outcome.acks) == sorted(e.entry_id for e in entries)
    assert len(replies) == 10 and not outcome.dead
    for i in range(10):
        np.testing.assert_array_equal(replies[f"c:{i}"].vector(), backend.logprobs_of([1, 2, i]))


async def test_identical_prompts_in_a_batch_are_computed_once(backend):
    processor = BatchProcessor(backend, cache=None)
    outcome = await processor.process([_entry(i, [7, 7, 7]) for i in range(6)])
    assert len(_replies(outcome)) == 6
    assert backend.batch_sizes == [1]


async def test_float16_requests_get_float16_payloads(backend):
    processor = BatchProcessor(backend, cache=None)
    outcome = await processor.process([_entry(0, [3], dtype="float16")])
    reply = _replies(outcome)["c:0"]
    assert reply.dtype == "float16" and reply.vector().dtype == np.dtype("<f2")
    np.testing.assert_allclose(reply.vector(), backend.logprobs_of([3]), atol=0.02)


@pytest.mark.parametrize(
    ("tokens", "fields", "error"),
    [
        ([], {}, EmptyPrompt),
        ([49152], {}, TokenOutOfVocabulary),
        ([-1], {}, TokenOutOfVocabulary),
        ([1] * 9000, {}, PromptTooLong),
        ([1], {"deadline_ms": 1}, DeadlineExceeded),
        ([1], {"kind": "mass"}, BadRequest),
    ],
)
async def test_bad_requests_get_typed_errors_and_never_reach_the_model(
    backend, tokens, fields, error
):
    processor = BatchProcessor(backend, cache=None, max_prompt_tokens=8192)
    outcome = await processor.process([_entry(0, tokens, **fields), _entry(1, [5])])
    replies = _replies(outcome)
    assert type(replies["c:0"].error) is error
    assert replies["c:1"].ok
    assert backend.batch_sizes == [1]


_MOCKS: dict[int, MockAsyncLM] = {}


def _shared_mock(tokenizer: Any) -> MockAsyncLM:
    """One mock of few precomputed vectors for every example (made once: it decodes the
    vocabulary)."""
    if id(tokenizer) not in _MOCKS:
        _MOCKS[id(tokenizer)] = MockAsyncLM(tokenizer, distinct_vectors=4)
    return _MOCKS[id(tokenizer)]


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.integers(0, 22).flatmap(
            lambda n: st.lists(st.integers(0, 49_151), min_size=n, max_size=n)
        ),
        min_size=1,
        max_size=6,
    ),
    st.one_of(
        st.none(),
        st.tuples(st.integers(0, 5), st.integers(0, 21), st.sampled_from([-1, 49_152, 2**31 - 1])),
    ),
)
@example([[5, 49_152], [3]], None)  # the edges, beside prompts that pass
@example([[5, 49_151], [-1, 3]], None)
@example([[1] * 21, [2] * 20], None)
@example([[], [2]], None)
async def test_a_batch_checks_each_prompt_as_it_would_be_checked_alone(
    smol_tokenizer, prompts: list[list[int]], bad: tuple[int, int, int] | None
) -> None:
    """Prompts are checked for the whole batch at once when all pass; any that does not
    (empty, too long, or with a token outside the vocabulary: `bad` puts one there) is told
    its own error, and the others run, whatever else shares their batch."""
    if bad is not None and prompts[bad[0] % len(prompts)]:
        ids = prompts[bad[0] % len(prompts)]
        ids[bad[1] % len(ids)] = bad[2]
    backend = _shared_mock(smol_tokenizer)
    processor = BatchProcessor(backend, cache=None, max_prompt_tokens=20)
    outcome = await processor.process([_entry(n, ids) for n, ids in enumerate(prompts)])
    replies = _replies(outcome)
    for n, ids in enumerate(prompts):
        try:
            check_token_bytes(ids_to_bytes(ids), backend.vocab_size, 20)
            want = None
        except LMQueueError as exc:
            want = type(exc)
        got = replies[f"c:{n}"]
        assert (type(got.error) if got.error else None) is want, (ids, got.error)
        if want is None:
            np.testing.assert_array_equal(got.vector(), backend.logprobs_of(ids))


async def test_oversize_entries_are_refused(backend):
    processor = BatchProcessor(backend, cache=None, max_request_bytes=1000)
    outcome = await processor.process([_entry(0, list(range(400)))])
    assert isinstance(_replies(outcome)["c:0"].error, OversizeRequest)


async def test_malformed_entries_with_a_sender_get_an_error_reply(backend):
    envelope = msgpack.packb({"v": 1, "id": "c:9", "client": "c", "kind": "nope"})
    outcome = await BatchProcessor(backend, cache=None).process([Entry("1-9", {b"m": envelope})])
    assert isinstance(_replies(outcome)["c:9"].error, MalformedMessage)
    assert outcome.acks == ["1-9"] and not outcome.dead


@pytest.mark.parametrize(
    "fields",
    [
        {b"m": b"\xff\xfe"},
        {b"junk": b"1"},
        {b"m": msgpack.packb({"v": 1, "id": "x", "client": "../../evil", "kind": "nope"})},
    ],
)
async def test_anonymous_malformed_entries_are_dead_lettered(backend, fields):
    outcome = await BatchProcessor(backend, cache=None).process([Entry("1-1", fields)])
    assert not outcome.replies and len(outcome.dead) == 1 and outcome.acks == ["1-1"]
    assert outcome.dead[0][1].startswith("MalformedMessage")


async def test_a_poison_request_is_isolated_and_the_rest_of_the_batch_succeeds(backend):
    processor = BatchProcessor(backend, cache=None)
    entries = [_entry(i, [1, i + 1]) for i in range(15)] + [_entry(99, [1, POISON])]
    outcome = await processor.process(entries)
    replies = _replies(outcome)
    assert isinstance(replies["c:99"].error, ModelError)
    assert all(replies[f"c:{i}"].ok for i in range(15))
    assert len(backend.batch_sizes) <= 1 + 2 * 4  # bisection: log2(16) levels, two halves each


async def test_every_result_of_a_large_batch_matches_the_backend(backend):
    processor = BatchProcessor(backend, cache=None)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 49152, size=rng.integers(1, 20)).tolist() for _ in range(64)]
    started = time.perf_counter()
    outcome = await processor.process([_entry(i, p) for i, p in enumerate(prompts)])
    assert time.perf_counter() - started < 60
    replies = _replies(outcome)
    for i, prompt in enumerate(prompts):
        np.testing.assert_array_equal(replies[f"c:{i}"].vector(), backend.logprobs_of(prompt))


def test_an_entry_is_decoded_once_and_a_malformed_one_raises_each_time() -> None:
    fields = {
        k.encode(): v for k, v in encode_request(Request("r1", "c1", b"\x01\x00\x00\x00")).items()
    }
    entry = Entry("1-0", fields)
    assert entry.request() is entry.request()  # decoded when read, reused when picked
    assert entry == Entry("1-0", fields)  # the decoded request is no part of its value
    broken = Entry("2-0", {b"m": b"\xc1"})
    for _ in range(2):
        with pytest.raises(MalformedMessage):
            broken.request()


class _ReusingLM(MockAsyncLM):
    """A mock whose prefix cache holds the first 3 positions of every prompt."""

    def reused_tokens(self, prompts):
        return sum(min(3, len(ids)) for _, ids in prompts)


async def test_computed_tokens_leave_out_what_the_backend_reuses(smol_tokenizer):
    processor = BatchProcessor(_ReusingLM(smol_tokenizer), cache=None)
    entries = [_entry(i, [1, 2, 3, 4, i]) for i in range(4)] + [_entry(9, [1, 2, 3, 4, 0])]
    outcome = await processor.process(entries)
    assert outcome.computed_prompts == 4  # the duplicate is computed once
    assert outcome.computed_tokens == 4 * (5 - 3)
    plain = await BatchProcessor(MockAsyncLM(smol_tokenizer), cache=None).process(entries)
    assert plain.computed_tokens == 4 * 5  # nothing reused: the whole prompts
