"""arq's job serializer: msgpack, never pickle.

arq stores every job (function name, arguments, tries, enqueue time) and every result under its
own keys; by default it pickles them, so anyone who can write those keys could run code in the
scheduler. Jobs here carry only strings and numbers, and a failed job's exception is stored as
its ``"Type: message"`` text.
"""

from __future__ import annotations

import datetime
from typing import Any

import msgpack

__all__ = ["pack", "unpack"]


def _fallback(value: Any) -> Any:
    if isinstance(value, BaseException):
        return f"{type(value).__name__}: {value}"
    if isinstance(value, datetime.datetime | datetime.timedelta):
        return str(value)
    raise TypeError(f"cannot serialize {type(value).__name__} for arq")


def pack(value: Any) -> bytes:
    """Encode an arq job or result as msgpack."""
    return msgpack.packb(value, use_bin_type=True, default=_fallback)


def unpack(raw: bytes) -> Any:
    """Decode what `pack` encoded."""
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)
