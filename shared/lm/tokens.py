"""`Token`: a vocabulary entry's bytes that remember which token id they are."""

from __future__ import annotations

from typing import Any

__all__ = ["Token"]


class Token(bytes):
    """The bytes of one vocabulary entry, carrying its `token_id`.

    A subclass of `bytes`, so ``b"".join(tokens)``, slicing and ``.decode()`` work unchanged.
    Two tokens can share their bytes (a special token spelled like ordinary text, say), so
    `Token`s compare and hash by id among themselves, and by content against plain bytes.
    """

    token_id: int

    def __new__(cls, token_id: int, byte_string: bytes) -> Token:
        if not isinstance(token_id, int) or isinstance(token_id, bool):
            raise TypeError(f"token_id must be an int, got {type(token_id).__name__}")
        if not isinstance(byte_string, bytes):
            raise TypeError(f"byte_string must be bytes, got {type(byte_string).__name__}")
        token = super().__new__(cls, byte_string)
        token.token_id = token_id
        return token

    @property
    def byte_string(self) -> bytes:
        """The token's bytes as plain `bytes`."""
        return bytes(self)

    def __repr__(self) -> str:
        return f"Token({self.token_id}, {bytes(self)!r})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Token):
            return self.token_id == other.token_id
        return bytes.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self.token_id)

    def __lt__(self, other: Any) -> bool:
        if isinstance(other, Token):
            return self.token_id < other.token_id
        return NotImplemented

    def __reduce__(self) -> tuple[Any, ...]:
        return (Token, (self.token_id, bytes(self)))
