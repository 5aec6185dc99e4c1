"""`Outcome`: everything one batch must write back; `ReplyWriter` writes it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Iterator
from dataclasses import dataclass, field
from typing import Any

from lmqueue.shared.errors import LMQueueError
from lmqueue.shared.wire import (
    MAX_PACKED,
    DeferredPayload,
    encode_error,
    encode_packed,
    encode_result,
    packable,
    payload_size,
)

from .request_stream import Entry

__all__ = ["Outcome", "Claimable"]

#: A payload as the processor hands it over: bytes, a view of a result vector, or a vector
#: the writer converts when it writes it.
Payload = bytes | memoryview | DeferredPayload


@dataclass(slots=True)
class Claimable:
    """A result that travels as a claim-check if its cache entry gets written, else inline (a
    value, made once a reply on the worker's loop: not declared frozen, as
    `lmqueue.shared.wire.Request`)."""

    client_id: str
    request_id: str
    payload: Payload
    dtype: str
    key: str


@dataclass
class Outcome:
    """Replies, cache entries, acknowledgements and dead letters produced by one batch.

    Every entry read ends up in `acks`; each decodable one also gets exactly one reply, and
    the undecodable ones without a reply address go to `dead` instead. Fresh results whose
    payload is being written to the shared cache wait in `claimable`: the `ReplyWriter`
    decides whether each travels as a claim-check or inline.
    """

    replies: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    cache_puts: list[tuple[str, Payload]] = field(default_factory=list)
    acks: list[str] = field(default_factory=list)
    dead: list[tuple[Entry, str]] = field(default_factory=list)
    claimable: list[Claimable] = field(default_factory=list)
    #: Replies by outcome, for metrics: ``ok`` or the error's class name as sent on the wire.
    outcomes: Counter[str] = field(default_factory=Counter)
    #: What the batch cost the backend: distinct prompts computed, and their tokens (cache
    #: hits and requests sharing a prompt cost nothing more); the fair-share charge.
    computed_prompts: int = 0
    computed_tokens: int = 0
    #: Clients whose requests said they read packed reply entries (`shared.wire`).
    packing: set[str] = field(default_factory=set)
    #: `acks` by the request stream each entry was read from, when the batch read several
    #: (a tenant's partitions of a cluster, answered together); None: all are of the writer's
    #: own stream.
    acks_by_stream: dict[str, list[str]] | None = None

    def ack_groups(self, own_stream: str) -> list[tuple[str, list[str]]]:
        """The entries to acknowledge, by stream (`own_stream` for all unless told otherwise)."""
        if self.acks_by_stream is None:
            return [(own_stream, self.acks)] if self.acks else []
        return [(stream, ids) for stream, ids in self.acks_by_stream.items() if ids]

    def result(
        self, client_id: str, request_id: str, payload: Payload, dtype: str, cached: bool
    ) -> None:
        """Add a result reply."""
        self.replies.append((client_id, encode_result(request_id, payload, dtype, cached)))
        self.outcomes["ok"] += 1

    def claimable_result(
        self, client_id: str, request_id: str, payload: Payload, dtype: str, key: str
    ) -> None:
        """Add a freshly computed result whose payload is also being written under `key`."""
        self.claimable.append(Claimable(client_id, request_id, payload, dtype, key))
        self.outcomes["ok"] += 1

    def error(self, client_id: str, request_id: str, error: BaseException) -> None:
        """Add an error reply."""
        self.replies.append((client_id, encode_error(request_id, error)))
        wire_type = type(error).__name__ if isinstance(error, LMQueueError) else "ModelError"
        self.outcomes[wire_type] += 1

    def dead_letter(self, entry: Entry, error: LMQueueError) -> None:
        """Park an entry nobody can be told about, with the reason."""
        self.dead.append((entry, f"{type(error).__name__}: {error.message}"))

    def reply_entries(self) -> list[tuple[str, dict[str, Any]]]:
        """The reply entries to add, by client: a packing client's replies without payload
        (claim-checks, errors) in packed entries, in the place of the first of them; the rest
        an entry each, in their order."""
        if not self.packing:
            return self.replies
        packs: dict[str, list[dict[str, Any]]] = {}
        entries: list[tuple[str, Any]] = []
        for client_id, fields in self.replies:
            if client_id in self.packing and packable(fields):
                pack = packs.get(client_id)
                if pack is None or len(pack) == MAX_PACKED:
                    pack = packs[client_id] = []
                    entries.append((client_id, pack))
                pack.append(fields)
            else:
                entries.append((client_id, fields))
        return [
            (client_id, _packed(fields) if isinstance(fields, list) else fields)
            for client_id, fields in entries
        ]

    def in_parts(self, budget: int) -> Iterator[Outcome]:
        """Its `leading_part`s, then itself with what is left. A part is dropped once the
        caller asks for the next, after writing it: one whose writing failed stays."""
        while (part := self.leading_part(budget)) is not None:
            keys = {item.key for item in part.claimable}  # (writing a part settles them)
            yield part
            self.drop(keys)
        yield self

    def leading_part(self, budget: int) -> Outcome | None:
        """The first claimable results, about `budget` bytes of them, with their cache entries
        (every claimable sharing their keys), if more remain after them; else None.

        The writer writes a large batch's fresh results in such parts, acknowledging nothing
        until the last (`ReplyWriter`): a client reads the first part while the rest is written.
        """
        keys: set[str] = set()
        size = 0
        for item in self.claimable:
            if size >= budget:
                break
            if item.key not in keys:
                keys.add(item.key)
                size += payload_size(item.payload)
        if len(keys) == len({item.key for item in self.claimable}):
            return None  # all of them: nothing would be left for a later part
        part = Outcome(packing=self.packing)
        part.claimable = [item for item in self.claimable if item.key in keys]
        part.cache_puts = [put for put in self.cache_puts if put[0] in keys]
        return part

    def drop(self, keys: Container[str]) -> None:
        """Forget the results and cache entries of these keys: a written `leading_part`'s
        (still counted in `outcomes`: the metrics count the whole batch once it is written)."""
        self.claimable = [item for item in self.claimable if item.key not in keys]
        self.cache_puts = [put for put in self.cache_puts if put[0] not in keys]


def _packed(replies: list[dict[str, Any]]) -> dict[str, Any]:
    """One reply as it is, several in a packed entry."""
    return replies[0] if len(replies) == 1 else encode_packed(replies)
