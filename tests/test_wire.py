"""Wire formats: round trips, and every malformed input ends in MalformedMessage."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmqueue.shared.errors import (
    Busy,
    DeadlineExceeded,
    LMQueueError,
    MalformedMessage,
    ModelError,
    TokenOutOfVocabulary,
)
from lmqueue.shared.wire import (
    Request,
    bytes_to_ids,
    bytes_to_vector,
    decode_packed,
    decode_reply,
    decode_request,
    encode_claim,
    encode_error,
    encode_packed,
    encode_request,
    encode_result,
    ids_to_bytes,
    vector_to_bytes,
)


def _as_read(fields: dict[str, bytes]) -> dict[bytes, bytes]:
    """Fields as redis-py returns them: bytes keys."""
    return {key.encode(): value for key, value in fields.items()}


def test_a_logprobs_request_survives_the_round_trip():
    request = Request("c1:7", "c1", ids_to_bytes([5, 9, 49151]), "logprobs", "float16", 123)
    decoded = decode_request(_as_read(encode_request(request)))
    assert decoded == request
    assert decoded.tokens.tolist() == [5, 9, 49151]


def test_a_request_says_whether_its_sender_reads_packed_replies():
    for packs in (False, True):
        request = Request("c1:8", "c1", ids_to_bytes([5]), packs=packs)
        envelope = msgpack.unpackb(encode_request(request)["m"])
        assert ("packs" in envelope) is packs
        assert decode_request(_as_read(encode_request(request))).packs is packs


def test_a_request_says_whether_its_sender_looked_it_up_in_the_shared_cache():
    for looked in (False, True):
        request = Request("c1:9", "c1", ids_to_bytes([5]), looked=looked)
        envelope = msgpack.unpackb(encode_request(request)["m"])
        assert ("looked" in envelope) is looked
        assert decode_request(_as_read(encode_request(request))).looked is looked
    envelope = msgpack.unpackb(encode_request(Request("c1:9", "c1", ids_to_bytes([5])))["m"])
    with pytest.raises(MalformedMessage, match="looked"):
        decode_request({b"m": msgpack.packb({**envelope, "looked": 1})})


@pytest.mark.parametrize("count", [1, 15, 16, 70, 4096])
def test_packed_replies_decode_in_order_as_they_would_one_by_one(count):
    singles = [
        encode_claim(f"c1:{n}", f"lmq:k{n}", "float16")
        if n % 3
        else encode_error(f"c1:{n}", Busy("x"))
        for n in range(count)
    ]
    packed = _as_read(encode_packed(singles))
    assert list(packed) == [b"p"]

    def seen(reply):
        error = reply.error and (type(reply.error), reply.error.message, reply.error.data)
        return reply.request_id, reply.claim, reply.dtype, reply.payload, error

    one_by_one = [seen(decode_reply(_as_read(fields))) for fields in singles]
    assert [seen(reply) for reply in decode_packed(packed)] == one_by_one
    assert sum(1 for *_, error in one_by_one if error) == len(range(0, count, 3))


def test_a_packed_entry_holds_no_payload_and_a_bounded_count():
    with pytest.raises(ValueError):
        encode_packed([encode_result("c1:1", b"\0" * 4, "float32")])
    with pytest.raises(ValueError):
        encode_packed([])
    with pytest.raises(ValueError):
        encode_packed([encode_claim("c1:1", "k", "float32")] * 4097)


def test_a_bad_packed_header_fails_its_own_reply_only():
    good = msgpack.packb({"v": 1, "id": "c1:1", "ok": True, "dtype": "float32", "claim": "k"})
    unknown = msgpack.packb({"v": 1, "id": "c1:2", "ok": True, "dtype": "float99", "claim": "k"})
    inline = msgpack.packb({"v": 1, "id": "c1:3", "ok": True, "dtype": "float32"})
    replies = decode_packed({b"p": b"\x94" + good + unknown + inline + msgpack.packb(7)})
    assert replies[0].claim == "k" and replies[0].request_id == "c1:1"
    assert [r.data.get("request_id") for r in replies[1:]] == ["c1:2", "c1:3", None]
    assert all(isinstance(r, MalformedMessage) for r in replies[1:])


def test_a_claim_check_naming_no_key_fails_with_its_request_id():
    """Found by the fuzz test below: an empty claim would send its client to read key ''."""
    empty = msgpack.packb({"v": 1, "id": "c1:4", "ok": True, "dtype": "float32", "claim": ""})
    (reply,) = decode_packed({b"p": b"\x91" + empty})
    assert isinstance(reply, MalformedMessage) and reply.data == {"request_id": "c1:4"}
    assert "names no cache key" in reply.message


@pytest.mark.parametrize(
    "fields",
    [
        {b"p": b"\xc1"},  # not msgpack
        {b"p": msgpack.packb({"v": 1})},  # not an array
        {b"p": msgpack.packb([])},  # empty
        {b"p": msgpack.packb([{}] * 4097)},  # too many
        {b"p": msgpack.packb([{}]), b"d": b"\0" * 4},  # a payload beside it
        {b"p": msgpack.packb([{}]), b"h": msgpack.packb({})},  # a single reply's header too
        {b"p": "text"},
        [b"p", b"x"],
    ],
)
def test_a_malformed_packed_entry_raises_malformed_message(fields):
    with pytest.raises(MalformedMessage):
        decode_packed(fields)


def test_a_mass_request_keeps_its_op_and_nodes():
    request = Request(
        "c:1", "c", ids_to_bytes([1]), "mass", "float64", 0, "max", ids_to_bytes([0, 4])
    )
    decoded = decode_request(_as_read(encode_request(request)))
    assert decoded.mass_op == "max"
    assert decoded.nodes is not None and decoded.nodes.tolist() == [0, 4]


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_vectors_travel_as_raw_little_endian_bytes(dtype):
    vector = np.linspace(-20, 0, 1000, dtype=np.float64)
    raw = vector_to_bytes(vector, dtype)
    assert len(raw) == 1000 * np.dtype(dtype).itemsize
    assert raw == vector.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    fields = _as_read(encode_result("r", raw, dtype))
    reply = decode_reply(fields)
    assert reply.ok and reply.dtype == dtype
    np.testing.assert_allclose(reply.vector(), vector, rtol=1e-3, atol=1e-2)


def test_torch_tensors_encode_like_numpy_arrays():
    torch = pytest.importorskip("torch")
    tensor = torch.log_softmax(torch.randn(300), dim=0)
    assert vector_to_bytes(tensor, "float32") == tensor.numpy().astype("<f4").tobytes()


@pytest.mark.parametrize(
    "error", [TokenOutOfVocabulary("bad id", token_id=5), Busy("full"), DeadlineExceeded("late")]
)
def test_errors_come_back_as_the_same_type_with_their_data(error):
    reply = decode_reply(_as_read(encode_error("r1", error)))
    assert not reply.ok
    assert type(reply.error) is type(error)
    assert reply.error.message == error.message and reply.error.data == error.data


def test_foreign_exceptions_travel_as_model_errors():
    reply = decode_reply(_as_read(encode_error("r1", KeyError("boom"))))
    assert isinstance(reply.error, ModelError)
    assert "KeyError" in reply.error.message


def test_a_builtin_error_hierarchy_is_kept_for_drop_in_compatibility():
    assert issubclass(TokenOutOfVocabulary, ValueError)
    assert issubclass(DeadlineExceeded, TimeoutError)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {b"m": b""},
        {b"m": b"\xc1"},
        {b"m": msgpack.packb([1, 2])},
        {b"m": msgpack.packb({"v": 99})},
        {b"m": msgpack.packb({"v": 1, "id": "x", "client": "c", "kind": "nope"})},
        {
            b"m": msgpack.packb(
                {
                    "v": 1,
                    "id": "x",
                    "client": "c",
                    "kind": "logprobs",
                    "tokens": b"\x01\x02\x03",
                    "dtype": "float32",
                    "deadline_ms": 0,
                }
            )
        },
        {
            b"m": msgpack.packb(
                {
                    "v": 1,
                    "id": "x",
                    "client": "c",
                    "kind": "logprobs",
                    "tokens": b"\x01\x00\x00\x00",
                    "dtype": "int8",
                    "deadline_ms": 0,
                }
            )
        },
        {
            b"m": msgpack.packb(
                {
                    "v": 1,
                    "id": "x",
                    "client": "c",
                    "kind": "logprobs",
                    "tokens": b"\x01\x00\x00\x00",
                    "dtype": "float32",
                    "deadline_ms": True,
                }
            )
        },
    ],
)
def test_malformed_requests_raise_malformed_message(fields):
    with pytest.raises(MalformedMessage):
        decode_request(fields)


def test_a_malformed_request_still_names_its_sender_when_it_can():
    fields = {b"m": msgpack.packb({"v": 1, "id": "c:3", "client": "c", "kind": "bogus"})}
    with pytest.raises(MalformedMessage) as caught:
        decode_request(fields)
    assert caught.value.data == {"request_id": "c:3", "client_id": "c"}


def test_ids_and_vectors_of_wrong_length_are_refused():
    with pytest.raises(MalformedMessage):
        bytes_to_ids(b"\x00" * 5)
    with pytest.raises(MalformedMessage):
        bytes_to_vector(b"\x00" * 6, "float32")
    with pytest.raises(MalformedMessage):
        bytes_to_vector(b"\x00" * 8, "complex")


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.binary(max_size=4), st.binary(max_size=64), max_size=4))
def test_fuzzed_request_fields_never_crash_the_decoder(fields):
    try:
        request = decode_request(fields)
    except MalformedMessage:
        return
    assert isinstance(request, Request)


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=6)
    ),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None)
@given(_json, st.one_of(st.none(), st.binary(max_size=16)))
def test_fuzzed_msgpack_envelopes_never_crash_either_decoder(envelope, payload):
    packed = msgpack.packb(envelope, use_bin_type=True)
    for decode, fields in (
        (decode_request, {b"m": packed}),
        (decode_reply, {b"h": packed, **({b"d": payload} if payload is not None else {})}),
    ):
        try:
            decoded = decode(fields)
        except MalformedMessage:
            continue
        assert decoded is not None


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries(
        {
            "v": st.just(1),
            "id": st.text(max_size=5),
            "ok": st.booleans(),
            "dtype": st.sampled_from(["float32", "float16", "bogus"]),
            "error": _json,
        },
    ),
    st.binary(max_size=32),
)
def test_fuzzed_reply_headers_end_in_a_reply_or_malformed_message(header, payload):
    fields = {b"h": msgpack.packb(header, use_bin_type=True), b"d": payload}
    try:
        reply = decode_reply(fields)
    except MalformedMessage:
        return
    assert reply.ok or isinstance(reply.error, LMQueueError)


def _corrupt(raw: bytes, patch: bytes, at: int) -> bytes:
    """`raw` with `patch` written over it at `at` (clamped), then cut to its first length."""
    at = min(at, len(raw))
    return (raw[:at] + patch + raw[at + len(patch) :])[: max(len(raw), 1)]


_KIND = st.sampled_from(["logprobs", "mass"])


@settings(max_examples=400, deadline=None)
@given(st.binary(min_size=1, max_size=6), st.integers(0, 200), _KIND)
def test_corrupted_valid_requests_decode_or_raise_malformed_message(patch, at, kind):
    """Random bytes and msgpack trees rarely pass the version check; corrupted real envelopes
    reach every field's validation."""
    nodes = ids_to_bytes([4])
    request = Request("c:1", "c", ids_to_bytes([1, 2, 3]), kind, "float16", 5, "max", nodes)
    envelope = encode_request(request)["m"]
    try:
        decoded = decode_request({b"m": _corrupt(envelope, patch, at)})
    except MalformedMessage:
        return
    assert decoded.kind in ("logprobs", "mass")
    assert len(decoded.tokens) * 4 == len(decoded.token_bytes)


@settings(max_examples=400, deadline=None)
@given(st.binary(min_size=1, max_size=6), st.integers(0, 120), st.booleans())
def test_corrupted_valid_replies_decode_or_raise_malformed_message(patch, at, ok):
    fields = encode_result("c:1", b"\x00" * 16, "float32") if ok else encode_error("c:1", Busy("x"))
    header = _corrupt(fields["h"], patch, at)
    try:
        reply = decode_reply({**_as_read(fields), b"h": header})
    except MalformedMessage:
        return
    assert reply.ok == (reply.error is None)
    if reply.ok:
        assert reply.vector().nbytes == 16


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        _json
        | st.fixed_dictionaries(
            {
                "v": st.just(1),
                "id": st.text(max_size=4),
                "ok": st.booleans(),
                "dtype": st.sampled_from(["float32", "bogus"]),
                "claim": _json,
                "error": _json,
            }
        ),
        max_size=6,
    )
)
def test_fuzzed_packed_entries_end_in_replies_or_malformed_messages(headers):
    try:
        replies = decode_packed({b"p": msgpack.packb(headers, use_bin_type=True)})
    except MalformedMessage:
        return
    assert len(replies) == len(headers)
    assert all(isinstance(r, MalformedMessage) or r.claim or r.error for r in replies)
