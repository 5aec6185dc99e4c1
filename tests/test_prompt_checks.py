"""`check_token_bytes` (the worker's check of a prompt as the wire carries it) refuses exactly
what `check_prompt` (every other caller's) refuses, with the same error and details."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmqueue.shared.errors import LMQueueError
from lmqueue.shared.lm.validation import check_prompt, check_token_bytes
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
