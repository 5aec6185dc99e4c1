"""`ReplyBatch`: the replies of one read of a client's reply stream, decoded.

Whichever way a read went (the client's reply thread, or redis-py on the event loop), its
entries are decoded here into results and errors ready to settle, claim-checks still to
resolve, and entries that did not decode; `ReplyReader` settles them on the loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lmqueue.shared.errors import MalformedMessage
from lmqueue.shared.wire import Reply, decode_packed, decode_reply

__all__ = ["ReplyBatch", "decode_entries", "run_id_of", "after"]


@dataclass
class ReplyBatch:
    """One read: what it holds, and the server's identity if it was asked."""

    #: Id of the last entry read (None: nothing read).
    last_id: str | None = None
    #: ``INFO server``'s run id, when the read checked it.
    run_id: str | None = None
    #: Replies read (a packed entry counts each of its replies).
    read: int = 0
    #: Results (payload present) and errors, ready to settle.
    ready: list[Reply] = field(default_factory=list)
    #: Claim-checks not resolved yet (the event loop's path resolves them after the read).
    claims: list[Reply] = field(default_factory=list)
    #: Claim-checks whose vectors were gone (the reply thread resolved them already).
    missed: list[Reply] = field(default_factory=list)
    #: Claims found in the shared cache by the reply thread (they are in `ready`).
    found: int = 0
    #: Entries that did not decode: their entry id, and the error (its request id, if read).
    malformed: list[tuple[str, MalformedMessage]] = field(default_factory=list)


def decode_entries(entries: Sequence[tuple[Any, Any]], batch: ReplyBatch) -> ReplyBatch:
    """Decode stream entries (fields as a dict, or RESP's flat name-value list) into `batch`."""
    for entry_id, fields in entries:
        batch.last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        fields = fields if isinstance(fields, dict) else _pairs(fields)
        try:
            if b"p" in fields:  # several replies without payload, packed (shared.wire)
                decoded = decode_packed(fields)
            else:
                decoded = [decode_reply(fields)]
        except MalformedMessage as exc:
            batch.read += 1
            batch.malformed.append((batch.last_id, exc))
            continue
        batch.read += len(decoded)
        for reply in decoded:
            if isinstance(reply, MalformedMessage):
                batch.malformed.append((batch.last_id, reply))
            elif reply.claim is None:
                batch.ready.append(reply)
            else:
                batch.claims.append(reply)
    return batch


def _pairs(flat: list[Any]) -> dict[bytes, Any]:
    """A stream entry's fields from the flat [name, value, name, value, ...] of RESP."""
    items = iter(flat)
    return dict(zip(items, items, strict=False))  # Redis always sends them in pairs


def run_id_of(info: Any) -> str:
    """The ``run_id`` line of an ``INFO server`` reply."""
    for line in bytes(info).split(b"\r\n"):
        if line.startswith(b"run_id:"):
            return line[7:].decode()
    raise ValueError("INFO server lacks run_id")


def after(entry_id: bytes | str) -> str:
    """The smallest stream id greater than `entry_id`."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, seq = text.split("-")
    return f"{ms}-{int(seq) + 1}"
