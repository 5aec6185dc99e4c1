"""Wire formats of requests and replies on Redis streams.

A stream entry is a map of fields. Requests carry one field ``m``: a msgpack envelope. Replies
carry ``h``, a msgpack header, and for results ``d``, the vector as raw little-endian bytes
(never a msgpack float list: raw bytes are 2.25x smaller and ~100x faster to decode, and
`numpy.frombuffer` reads them without a copy). Token ids and node ids travel the same way, as
little-endian int32 bytes.

A result the worker also wrote to the shared cache may travel as a *claim-check* instead: a
header naming the cache key (``claim``) and no ``d``, so the vector crosses the network once
each way (worker -> cache -> client) instead of twice. Only requests that say they can resolve
claims (``claims``) get them, so old clients and old workers keep talking inline; a client
whose claimed key is gone asks again without ``claims``.

Replies without a payload (claim-checks, errors) of one client in one batch may travel
*packed*: one entry whose field ``p`` is a msgpack array of their headers, instead of an entry
each. A batch of 64 claim-checks is then one XADD for the worker, one entry for Redis to store
and serve, and one msgpack decode for the client (~50 CPU us a reply less over the three
processes: docs/benchmarks-history.md, section 1). Only senders that say they read them
(``packs``) get packed entries. Results with a payload stay an entry each: a read's size stays
bounded by its entry count.

A request whose client looked its result up in the shared cache just before sending it (and
missed) says so (``looked``): the worker then looks it up again only where it wrote that
result itself since (`workers.recent_writes`), instead of a second lookup of every request.

A request for a LoRA adapter names it in ``adapter`` (absent: the base model). The name is
untrusted tenant input: the decoder checks its shape (`shared.adapters.ADAPTER_NAME`), the
worker that it is served and that the tenant may use it.

Every envelope carries the format version ``v``. Decoding validates every field and raises
`MalformedMessage`, never anything else, so a reader can always answer or park a bad entry.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from .adapters import ADAPTER_NAME
from .errors import LMQueueError, MalformedMessage, from_wire, to_wire
from .serial_torch import serial_here

__all__ = [
    "WIRE_VERSION",
    "MAX_PACKED",
    "KINDS",
    "MASS_OPS",
    "VECTOR_DTYPES",
    "Request",
    "Reply",
    "encode_request",
    "decode_request",
    "envelope_token_count",
    "encode_result",
    "encode_claim",
    "encode_error",
    "decode_reply",
    "encode_packed",
    "decode_packed",
    "packable",
    "ids_to_bytes",
    "bytes_to_ids",
    "vector_to_bytes",
    "vector_payload",
    "DeferredPayload",
    "deferred_payload",
    "payload_bytes",
    "payload_size",
    "bytes_to_vector",
    "check_payload",
    "cast_in_chunks",
    "holds_vector",
]

WIRE_VERSION = 1
#: What a request asks for: the next-token log-probabilities, or trie masses derived from them.
KINDS = ("logprobs", "mass")
MASS_OPS = ("sum", "max")
#: Dtypes a vector may travel in, by wire name. numpy has no bfloat16: its vectors are read as
#: their raw 16-bit patterns (``<u2``), the upper halves of float32 values; clients widen
#: them (`producer.tensors.widened`).
VECTOR_DTYPES = {"float32": "<f4", "float16": "<f2", "float64": "<f8", "bfloat16": "<u2"}

_ITEMSIZES = {name: np.dtype(code).itemsize for name, code in VECTOR_DTYPES.items()}
_MAX_ENVELOPE_BYTES = 64 * 1024 * 1024


def ids_to_bytes(ids: Any) -> bytes:
    """Encode a sequence of integer ids as little-endian int32 bytes."""
    return np.asarray(ids, dtype="<i4").tobytes()


def bytes_to_ids(raw: bytes) -> np.ndarray:
    """Decode little-endian int32 bytes into a read-only int32 array (no copy)."""
    _check_id_bytes(raw)
    return np.frombuffer(raw, dtype="<i4")


def _check_id_bytes(raw: bytes) -> None:
    if len(raw) % 4:
        raise MalformedMessage(f"id bytes have length {len(raw)}, not a multiple of 4")


def vector_to_bytes(vector: Any, dtype: str) -> bytes:
    """Encode a 1-d float vector (numpy or torch, any device) in the named wire dtype."""
    return bytes(vector_payload(vector, dtype))


def vector_payload(vector: Any, dtype: str) -> memoryview:
    """The bytes of `vector` in wire dtype `dtype`, as a view: no copy when none is needed.

    A float32 vector going out as float32 is viewed, not copied; the caller must not change it
    until the payload is written. float32 -> float16 uses torch's vectorized conversion (same
    round-to-nearest-even as numpy's ``astype``, ~10x faster here), in pieces small enough to
    stay off torch's thread pool.
    """
    if hasattr(vector, "detach"):  # a torch tensor; avoid importing torch here
        if vector.requires_grad:
            vector = vector.detach()
        if not vector.is_cpu:
            vector = vector.to("cpu")
        if dtype in _HALVES and _HALF_BY_TORCH and vector.dtype is _torch_float32():
            return _half_of_tensor(vector, dtype)
        vector = vector.numpy()
    if dtype == "bfloat16":
        return _bfloat16_of(vector)
    if (
        dtype == "float16"
        and _HALF_BY_TORCH
        and "torch" in sys.modules  # imported by every worker and client; never imported here
        and isinstance(vector, np.ndarray)
        and vector.dtype == np.float32
        and vector.flags.writeable  # torch cannot view a read-only array without a warning
    ):
        return _half_of_tensor(sys.modules["torch"].from_numpy(vector))
    return np.ascontiguousarray(vector, dtype=VECTOR_DTYPES[dtype]).data.cast("B")


class DeferredPayload:
    """A vector whose wire bytes are made when it is written, not when it is computed.

    A worker's writer thread writes a batch's replies while the event loop goes on with the
    next batch; converting to a 16-bit dtype (or copying off a GPU) there instead of on the
    loop takes that work off the loop's thread (torch releases the GIL meanwhile).
    The vector must stay unchanged until then, as a float32 payload's view requires anyway.
    One thread makes the bytes, once (`payload_bytes`).
    """

    __slots__ = ("vector", "dtype", "_bytes")

    def __init__(self, vector: Any, dtype: str) -> None:
        self.vector = vector
        self.dtype = dtype
        self._bytes: memoryview | None = None

    @property
    def nbytes(self) -> int:
        """The wire bytes' length, without making them."""
        if self._bytes is not None:
            return self._bytes.nbytes
        vector = self.vector
        count = vector.numel() if hasattr(vector, "numel") else vector.size
        return int(count) * np.dtype(VECTOR_DTYPES[self.dtype]).itemsize

    def view(self) -> memoryview:
        """The wire bytes (made on the first call)."""
        if self._bytes is None:
            self._bytes, self.vector = vector_payload(self.vector, self.dtype), None
        return self._bytes


def deferred_payload(vector: Any, dtype: str) -> memoryview | DeferredPayload:
    """`vector_payload`, deferred (`DeferredPayload`) where it converts a CPU vector.

    A float32 payload is a view of `vector` anyway; a vector on a device is copied off it now,
    since the engine may reuse that memory once its call returned (a CPU result must stay
    unchanged until written already: float32 ones go out as views of it).
    """
    if not getattr(vector, "is_cpu", True):
        return vector_payload(vector, dtype)
    if dtype == "float32" and getattr(vector, "dtype", None) in (
        np.float32,
        _torch_float32_or_none(),
    ):
        return vector_payload(vector, dtype)
    return DeferredPayload(vector, dtype)


def payload_size(payload: Any) -> int:
    """The wire bytes of a payload, without making a deferred one's."""
    return payload.nbytes if isinstance(payload, memoryview | DeferredPayload) else len(payload)


def payload_bytes(payload: Any) -> Any:
    """The bytes of a payload that may be deferred (anything else is returned as it is)."""
    return payload.view() if isinstance(payload, DeferredPayload) else payload


def bytes_to_vector(raw: bytes | memoryview, dtype: str) -> np.ndarray:
    """Decode raw little-endian bytes of the named wire dtype (no copy, read-only)."""
    check_payload(raw, dtype)
    return np.frombuffer(raw, dtype=VECTOR_DTYPES[dtype])


def check_payload(payload: bytes | memoryview, dtype: str) -> None:
    """Raise `MalformedMessage` unless `payload` holds whole values of the named wire dtype."""
    itemsize = _ITEMSIZES.get(dtype)
    if itemsize is None:
        raise MalformedMessage(f"unknown vector dtype {dtype!r}")
    size = payload.nbytes if isinstance(payload, memoryview) else len(payload)
    if size % itemsize:
        raise MalformedMessage(f"{size} payload bytes do not hold whole {dtype} values")


def holds_vector(value: Any, dtype: str, vector_size: int = 0) -> bool:
    """Whether a cached or claimed `value` is a vector of `dtype` (and `vector_size` values).

    Readers of cached vectors trust nothing they did not compute: anything else is a miss.
    """
    if not value:
        return False
    itemsize = _ITEMSIZES.get(dtype)
    if itemsize is None:
        return False
    size = value.nbytes if isinstance(value, memoryview) else len(value)
    if vector_size:
        return size == vector_size * itemsize
    return size % itemsize == 0


#: Largest piece converted by one torch op. From 32,768 elements (ATen's GRAIN_SIZE) torch hands
#: an op to its OpenMP team, whose threads then spin for milliseconds, burning the cores the
#: queue needs; below, it runs inline. Fewer pieces, less overhead (each costs its dispatch).
_HALF_CHUNK = 32_760
#: torch tensors are native-endian; the wire is little-endian.
_HALF_BY_TORCH = sys.byteorder == "little"
#: The 16-bit wire dtypes torch converts to.
_HALVES = ("float16", "bfloat16")


def cast_in_chunks(destination: Any, source: Any) -> None:
    """Copy torch tensor `source` into `destination`, converting dtype, one serial chunk at a time.

    Both are 1-d tensors of one length. torch converts float32 <-> float16 with F16C, an order
    of magnitude faster than numpy, rounding to nearest even as numpy does.
    On a thread whose torch ops run serially anyway (`shared.serial_torch`) it is one op:
    each piece costs a few microseconds of dispatch.
    """
    if serial_here():
        destination.copy_(source)
        return
    for start in range(0, destination.shape[0], _HALF_CHUNK):  # slices: Tensor.split costs more
        end = start + _HALF_CHUNK
        destination[start:end].copy_(source[start:end])


def _torch_float32() -> Any:
    return sys.modules["torch"].float32


def _torch_float32_or_none() -> Any:
    torch = sys.modules.get("torch")
    return torch.float32 if torch is not None else None


def _half_of_tensor(tensor: Any, dtype: str = "float16") -> memoryview:
    """float16 or bfloat16 bytes of a 1-d float32 CPU tensor."""
    torch = sys.modules["torch"]
    if dtype == "float16":
        out = np.empty(tensor.numel(), dtype="<f2")
        cast_in_chunks(torch.from_numpy(out), tensor.reshape(-1))
    else:  # torch rounds to nearest even, and keeps NaN a NaN
        out = np.empty(tensor.numel(), dtype="<i2")
        cast_in_chunks(torch.from_numpy(out).view(torch.bfloat16), tensor.reshape(-1))
    return out.data.cast("B")


def _bfloat16_of(vector: Any) -> memoryview:
    """bfloat16 bytes of a numpy vector (torch converts it; workers always import torch)."""
    import torch  # imported already wherever vectors are made

    single = np.ascontiguousarray(vector, dtype=np.float32)
    if not single.flags.writeable:  # torch cannot view read-only memory without a warning
        single = single.copy()
    return _half_of_tensor(torch.from_numpy(single.reshape(-1)), "bfloat16")


@dataclass(slots=True)
class Request:
    """One request: a tokenized prompt and what to compute from its next-token distribution.

    A value: never changed once made (`dataclasses.replace` makes another). Not declared
    frozen: a frozen dataclass sets each field through ``object.__setattr__``, which made its
    13 fields cost 1.7 us against 0.44 (`Request` is made once a request on the worker's loop
    and in the client; `Reply` once or twice a reply, `workers.request_stream.Entry` and
    `workers.fair_share.Pick` once a request too).
    """

    request_id: str
    client_id: str
    token_bytes: bytes
    kind: str = "logprobs"
    dtype: str = "float32"
    deadline_ms: int = 0
    mass_op: str = "sum"
    node_bytes: bytes | None = None
    #: Mass requests: digest of the vocabulary the client numbered trie nodes with.
    vocab_digest: str | None = None
    #: The sender resolves claim-check replies (see the module docstring).
    claims: bool = False
    #: The LoRA adapter to compute with (None: the base model).
    adapter: str | None = None
    #: The sender reads packed reply entries (see the module docstring).
    packs: bool = False
    #: The sender looked the result up in the shared cache before sending, and missed.
    looked: bool = False

    @property
    def tokens(self) -> np.ndarray:
        """The prompt's token ids."""
        return bytes_to_ids(self.token_bytes)

    @property
    def nodes(self) -> np.ndarray | None:
        """The trie node ids a mass request asks for, or None for all nodes."""
        return None if self.node_bytes is None else bytes_to_ids(self.node_bytes)


@dataclass(slots=True)
class Reply:
    """One reply: a result vector or an error, for one request id (a value, as `Request`)."""

    request_id: str
    payload: bytes | memoryview | None = None
    dtype: str = "float32"
    error: LMQueueError | None = None
    cached: bool = False
    #: A claim-check: the shared-cache key holding the vector; `payload` is then None.
    claim: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the reply carries a result."""
        return self.error is None

    def vector(self) -> np.ndarray:
        """The result vector (read-only view of the payload)."""
        if self.payload is None:
            what = "a claim-check, resolve it first" if self.claim else "no payload"
            raise MalformedMessage(f"reply carries {what}")
        return bytes_to_vector(self.payload, self.dtype)


def encode_request(request: Request) -> dict[str, bytes]:
    """Encode a request as stream-entry fields."""
    envelope: dict[str, Any] = {
        "v": WIRE_VERSION,
        "id": request.request_id,
        "client": request.client_id,
        "kind": request.kind,
        "tokens": request.token_bytes,
        "dtype": request.dtype,
        "deadline_ms": request.deadline_ms,
    }
    if request.kind == "mass":
        envelope["op"] = request.mass_op
        if request.node_bytes is not None:
            envelope["nodes"] = request.node_bytes
        if request.vocab_digest is not None:
            envelope["vocab"] = request.vocab_digest
    if request.claims:
        envelope["claims"] = True
    if request.adapter is not None:
        envelope["adapter"] = request.adapter
    if request.packs:
        envelope["packs"] = True
    if request.looked:
        envelope["looked"] = True
    return {"m": _pack(envelope)}


def decode_request(fields: dict[bytes, bytes]) -> Request:
    """Decode and validate stream-entry fields into a `Request`.

    Raises:
        MalformedMessage: on any defect; its data carries ``request_id`` and ``client_id`` when
            they could be read, so that the reader can still answer the sender.
    """
    envelope = _unpack_envelope(fields, b"m")
    try:
        return _request_from_envelope(envelope)
    except MalformedMessage as exc:
        ids = {
            key: envelope[wire]
            for key, wire in (("request_id", "id"), ("client_id", "client"))
            if isinstance(envelope.get(wire), str)
        }
        raise MalformedMessage(exc.message, **ids) from None


def _request_from_envelope(envelope: dict[str, Any]) -> Request:
    _check_version(envelope)
    get: Any = envelope.get  # values of any type until checked
    request_id, client_id, kind = get("id"), get("client"), get("kind")
    tokens, dtype, deadline_ms = get("tokens"), get("dtype"), get("deadline_ms")
    # the usual envelope, read as msgpack makes it, in one test; else each field's own check
    # (one call each: a few microseconds a request on the worker's loop) names what is wrong
    usual = type(request_id) is str and type(client_id) is str and type(kind) is str
    if not (usual and type(tokens) is bytes and type(dtype) is str and type(deadline_ms) is int):
        request_id = _field(envelope, "id", str)
        client_id = _field(envelope, "client", str)
        kind = _field(envelope, "kind", str)
    if kind not in KINDS:
        raise MalformedMessage(f"unknown request kind {kind!r}")
    tokens = _field(envelope, "tokens", bytes) if type(tokens) is not bytes else tokens
    _check_id_bytes(tokens)
    dtype = _field(envelope, "dtype", str) if type(dtype) is not str else dtype
    if dtype not in VECTOR_DTYPES:
        raise MalformedMessage(f"unknown vector dtype {dtype!r}")
    if type(deadline_ms) is not int:
        deadline_ms = _field(envelope, "deadline_ms", int)
    mass_op, node_bytes, vocab = "sum", None, None
    if kind == "mass":
        mass_op = _field(envelope, "op", str)
        if mass_op not in MASS_OPS:
            raise MalformedMessage(f"unknown mass op {mass_op!r}")
        if "nodes" in envelope:
            node_bytes = _field(envelope, "nodes", bytes)
            _check_id_bytes(node_bytes)
        if "vocab" in envelope:
            vocab = _field(envelope, "vocab", str)
    claims, packs, looked = get("claims", False), get("packs", False), get("looked", False)
    if not (type(claims) is bool and type(packs) is bool and type(looked) is bool):
        claims = "claims" in envelope and _field(envelope, "claims", bool)
        packs = "packs" in envelope and _field(envelope, "packs", bool)
        looked = "looked" in envelope and _field(envelope, "looked", bool)
    adapter = None
    if "adapter" in envelope:
        adapter = _field(envelope, "adapter", str)
        if not ADAPTER_NAME.match(adapter):
            raise MalformedMessage(f"invalid adapter name {adapter[:80]!r}")
    return Request(
        request_id, client_id, tokens, kind, dtype, deadline_ms, mass_op, node_bytes, vocab,
        claims, adapter, packs, looked,
    )  # fmt: skip


#: msgpack's ``"tokens"`` key as `encode_request` packs it, and the bin headers of 8, 16 and
#: 32-bit lengths that follow it.
_TOKENS_KEY = b"\xa6tokens"
_BIN_LENGTH_BYTES = {0xC4: 1, 0xC5: 2, 0xC6: 4}


def envelope_token_count(envelope: Any) -> int | None:
    """The prompt tokens of a request envelope (its ``m`` field), read off the length of its
    ``tokens`` bytes without decoding it; None if that is not found. Untrusted input: an
    estimate for scheduling, not a validation (`decode_request` validates)."""
    at = envelope.find(_TOKENS_KEY) if isinstance(envelope, bytes) else -1
    if at < 0:
        return None
    start = at + len(_TOKENS_KEY) + 1
    width = _BIN_LENGTH_BYTES.get(envelope[start - 1]) if start <= len(envelope) else None
    if width is None or start + width > len(envelope):
        return None
    return int.from_bytes(envelope[start : start + width], "big") // 4


def encode_result(
    request_id: str, payload: bytes | memoryview | DeferredPayload, dtype: str, cached: bool = False
) -> dict[str, Any]:
    """Encode a result reply; `payload` is the vector's raw bytes in `dtype` (or a
    `DeferredPayload`, made into them when written)."""
    header = {"v": WIRE_VERSION, "id": request_id, "ok": True, "dtype": dtype, "cached": cached}
    return {"h": _pack(header), "d": payload}


def encode_claim(request_id: str, key: str, dtype: str, cached: bool = False) -> dict[str, bytes]:
    """Encode a claim-check reply: the result is the `dtype` vector stored under cache `key`."""
    header = {
        "v": WIRE_VERSION, "id": request_id, "ok": True, "dtype": dtype, "cached": cached,
        "claim": key,
    }  # fmt: skip
    return {"h": _pack(header)}


def encode_error(request_id: str, error: BaseException) -> dict[str, bytes]:
    """Encode an error reply; foreign exceptions travel as `ModelError`."""
    header = {"v": WIRE_VERSION, "id": request_id, "ok": False, "error": to_wire(error)}
    return {"h": _pack(header)}


def decode_reply(fields: dict[bytes, bytes]) -> Reply:
    """Decode and validate reply-entry fields (one reply; `decode_packed` reads packed ones).

    Raises:
        MalformedMessage: on any defect; its data carries ``request_id`` when it could be read.
    """
    return _reply_of(_unpack_envelope(fields, b"h"), fields.get(b"d"))


def _reply_of(header: dict[str, Any], payload: Any) -> Reply:
    """A reply from its decoded header and its payload field (None: none)."""
    # The common replies, checked field by field in one pass (a client reads thousands a
    # second); anything else takes the long way, which says what is wrong.
    request_id, dtype = header.get("id"), header.get("dtype")
    if (
        header.get("ok") is True
        and header.get("v") == WIRE_VERSION
        and type(request_id) is str
        and type(dtype) is str
        and dtype in _ITEMSIZES
    ):
        cached = bool(header.get("cached", False))
        claim = header.get("claim")
        if claim is None and isinstance(payload, bytes | memoryview):
            size = payload.nbytes if isinstance(payload, memoryview) else len(payload)
            if not size % _ITEMSIZES[dtype]:
                return Reply(request_id, payload, dtype, cached=cached)
        elif type(claim) is str and claim and payload is None:
            return Reply(request_id, None, dtype, cached=cached, claim=claim)
    return _decode_reply_checked(header, payload)


def _decode_reply_checked(header: dict[str, Any], payload: Any) -> Reply:
    """`decode_reply`'s long way: each field checked in turn, the first defect raised."""
    request_id = header.get("id")
    try:
        _check_version(header)
        request_id = _field(header, "id", str)
        ok = _field(header, "ok", bool)
        if not ok:
            return Reply(request_id, error=from_wire(header.get("error")))
        dtype = _field(header, "dtype", str)
        if dtype not in _ITEMSIZES:
            raise MalformedMessage(f"unknown vector dtype {dtype!r}")
        cached = bool(header.get("cached", False))
        if "claim" in header:
            if payload is not None:
                raise MalformedMessage("a claim-check reply carries a payload too")
            claim = _field(header, "claim", str)
            if not claim:
                raise MalformedMessage("a claim-check reply names no cache key")
            return Reply(request_id, None, dtype, cached=cached, claim=claim)
        if not isinstance(payload, bytes | memoryview):  # a view: an outcome not yet written
            raise MalformedMessage("result reply lacks its payload field 'd'")
        check_payload(payload, dtype)
        return Reply(request_id, payload, dtype, cached=cached)
    except MalformedMessage as exc:
        data = {"request_id": request_id} if isinstance(request_id, str) else {}
        raise MalformedMessage(exc.message, **data) from None


#: Most replies one packed entry holds (its headers take ~100-200 bytes each).
MAX_PACKED = 4096


def packable(fields: dict[str, Any]) -> bool:
    """Whether reply-entry `fields` (as `encode_*` made them) may travel packed: no payload."""
    return "d" not in fields


def encode_packed(replies: list[dict[str, Any]]) -> dict[str, bytes]:
    """One entry's fields holding several `packable` replies (at most `MAX_PACKED`).

    Their headers are msgpack already: the array is their bytes behind an array header, so
    nothing is packed twice.
    """
    if not 0 < len(replies) <= MAX_PACKED:
        raise ValueError(f"a packed entry holds 1 to {MAX_PACKED} replies, not {len(replies)}")
    if not all(map(packable, replies)):
        raise ValueError("a reply with a payload does not travel packed")
    headers = [fields["h"] for fields in replies]
    return {"p": _array_header(len(headers)) + b"".join(headers)}


def decode_packed(fields: dict[bytes, Any]) -> list[Reply | MalformedMessage]:
    """The replies of a packed entry, in order; a reply that does not decode is its
    `MalformedMessage` (carrying ``request_id`` when it could be read) in its place.

    Raises:
        MalformedMessage: the entry itself is not a packed entry (no array, a payload field,
            too many replies).
    """
    if not isinstance(fields, dict):
        raise MalformedMessage(f"entry is {type(fields).__name__}, not a field map")
    if b"d" in fields or b"h" in fields:
        raise MalformedMessage("a packed entry carries a reply's own fields too")
    headers = _unpack_field(fields, b"p")
    if not isinstance(headers, list) or not 0 < len(headers) <= MAX_PACKED:
        raise MalformedMessage(f"packed replies are not an array of 1 to {MAX_PACKED} headers")
    replies: list[Reply | MalformedMessage] = []
    for header in headers:
        if not isinstance(header, dict):
            replies.append(MalformedMessage(f"packed header is {type(header).__name__}"))
            continue
        try:
            replies.append(_reply_of(header, None))
        except MalformedMessage as exc:
            replies.append(exc)
    return replies


def _array_header(length: int) -> bytes:
    """msgpack's header of an array of `length` items."""
    if length < 16:
        return bytes((0x90 | length,))
    if length < 1 << 16:
        return b"\xdc" + length.to_bytes(2, "big")
    return b"\xdd" + length.to_bytes(4, "big")


_packers = threading.local()


def _pack(envelope: dict[str, Any]) -> bytes:
    """msgpack bytes of `envelope`, by a reused Packer (``msgpack.packb`` builds one per call)."""
    try:
        packer = _packers.packer
    except AttributeError:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(envelope)


def _unpack_envelope(fields: Any, name: bytes) -> dict[str, Any]:
    envelope = _unpack_field(fields, name)
    if not isinstance(envelope, dict):
        raise MalformedMessage(f"envelope is {type(envelope).__name__}, not a map")
    return envelope


def _unpack_field(fields: Any, name: bytes) -> Any:
    """The msgpack value of field `name` of an entry, within the size limit."""
    if not isinstance(fields, dict):
        raise MalformedMessage(f"entry is {type(fields).__name__}, not a field map")
    raw = fields.get(name)
    if not isinstance(raw, bytes):
        raise MalformedMessage(f"entry lacks its {name.decode()!r} field")
    if len(raw) > _MAX_ENVELOPE_BYTES:
        raise MalformedMessage(f"envelope of {len(raw)} bytes is over the limit")
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises a zoo of types for garbage input
        raise MalformedMessage(f"envelope is not valid msgpack: {type(exc).__name__}") from None


def _check_version(envelope: dict[str, Any]) -> None:
    version = envelope.get("v")
    if version != WIRE_VERSION:
        raise MalformedMessage(f"unsupported wire version {version!r} (expected {WIRE_VERSION})")


def _field(envelope: dict[str, Any], name: str, kind: type) -> Any:
    value = envelope.get(name)
    # bool is an int subclass; an int field must not accept True
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise MalformedMessage(f"field {name!r} is missing or not {kind.__name__}")
    return value
