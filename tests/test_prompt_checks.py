"""`check_token_bytes` (the worker's check of a prompt as the wire carries it) refuses exactly
what `check_prompt` (every other caller's) refuses, with the same error and details; and
`prompt_bytes` (the client's check and packing in one, a fast path for short lists of ints)
refuses the same and packs what passes as the wire does."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmqueue.shared.errors import LMQueueError
from lmqueue.shared.lm.validation import check_prompt, check_token_bytes, prompt_bytes
from lmqueue.shared.wire import ids_to_bytes

VOCAB = 1000
LIMIT = 80


def _outcome(check, *args):
    try:
        check(*args)
    except LMQueueError as exc:
        return type(exc).__name__, exc.message, exc.data
    return None


# ids around every edge: negative, the vocabulary's end, int32's, prompts either side of the
# 64 ids reduced as a list and of the length limit
_ids = st.lists(
    st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([-1, VOCAB - 1, VOCAB, 2**31 - 1])),
    max_size=LIMIT + 8,
)


@settings(max_examples=300, deadline=None)
@given(ids=_ids, limit=st.sampled_from([0, LIMIT]))
def test_wire_bytes_are_refused_as_their_ids_are(ids, limit):
    assert _outcome(check_token_bytes, ids_to_bytes(ids), VOCAB, limit) == _outcome(
        check_prompt, ids, VOCAB, limit
    )


@pytest.mark.parametrize("length", [0, 1, 64, 65, 200])
def test_the_edges_of_the_small_prompt_path(length):
    ids = np.full(length, VOCAB - 1, dtype="<i4")
    expected = _outcome(check_prompt, ids.tolist(), VOCAB, 100)
    assert _outcome(check_token_bytes, ids.tobytes(), VOCAB, 100) == expected
    assert (expected is None) == (0 < length <= 100)
    ids[-1:] = VOCAB  # one id past the vocabulary, last
    if length:
        assert _outcome(check_token_bytes, ids.tobytes(), VOCAB, 0)[0] == "TokenOutOfVocabulary"


def _packed(ids, limit):
    """`prompt_bytes`'s bytes, or its refusal as `_outcome` reports one."""
    try:
        return prompt_bytes(ids, VOCAB, limit)
    except LMQueueError as exc:
        return type(exc).__name__, exc.message, exc.data


@settings(max_examples=300, deadline=None)
@given(ids=_ids, limit=st.sampled_from([0, LIMIT]))
def test_prompt_bytes_refuses_and_packs_as_check_prompt_and_the_wire(ids, limit):
    refused = _outcome(check_prompt, ids, VOCAB, limit)
    expected = refused if refused is not None else ids_to_bytes(ids)
    assert _packed(ids, limit) == expected


@pytest.mark.parametrize(
    "ids",
    [
        [1, True, 3],  # a bool is no token id
        [True],
        [1.0, 2.0],
        ["1"],
        [1, None],
        [[1, 2]],
        (1, 2, 3),  # not a list: numpy's path
        np.array([1, 2, 3], dtype=np.int64),
        np.array([1, 2, 3], dtype=np.uint16),
        [np.int64(5), 6],
        list(range(1, 70)),  # longer than the short path takes
        [2**40],
        [],
    ],
)
def test_prompt_bytes_of_any_other_sequence_is_check_prompt_s(ids):
    refused = _outcome(check_prompt, ids, VOCAB, 0)
    expected = refused if refused is not None else ids_to_bytes(check_prompt(ids, VOCAB, 0))
    assert _packed(ids, 0) == expected
