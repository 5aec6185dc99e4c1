"""`Outcome`: everything one batch must write back, flushed in one pipeline."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.errors import LMQueueError
from shared.wire import encode_error, encode_result

from .request_stream import Entry

__all__ = ["Outcome"]


@dataclass
class Outcome:
    """Replies, cache entries, acknowledgements and dead letters produced by one batch.

    Every entry read ends up in `acks`; each decodable one also gets exactly one reply, and
    the undecodable ones without a reply address go to `dead` instead.
    """

    replies: list[tuple[str, dict[str, bytes]]] = field(default_factory=list)
    cache_puts: list[tuple[str, bytes]] = field(default_factory=list)
    acks: list[str] = field(default_factory=list)
    dead: list[tuple[Entry, str]] = field(default_factory=list)

    def result(self, client_id: str, request_id: str, payload: bytes, dtype: str, cached: bool):
        """Add a result reply."""
        self.replies.append((client_id, encode_result(request_id, payload, dtype, cached)))

    def error(self, client_id: str, request_id: str, error: BaseException) -> None:
        """Add an error reply."""
        self.replies.append((client_id, encode_error(request_id, error)))

    def dead_letter(self, entry: Entry, error: LMQueueError) -> None:
        """Park an entry nobody can be told about, with the reason."""
        self.dead.append((entry, f"{type(error).__name__}: {error.message}"))

    def merge(self, other: Outcome) -> None:
        """Append everything of `other`."""
        self.replies.extend(other.replies)
        self.cache_puts.extend(other.cache_puts)
        self.acks.extend(other.acks)
        self.dead.extend(other.dead)
