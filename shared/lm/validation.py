"""Prompt validation, one implementation for client, worker and every backend."""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import EmptyPrompt, PromptTooLong, TokenOutOfVocabulary, UnknownAdapter
from ..wire import ids_to_bytes

__all__ = [
    "check_prompt",
    "check_token_bytes",
    "check_loaded_adapter",
    "prompt_bytes",
    "token_bytes_pass",
]

#: Prompts up to this long are checked with Python's min and max (most calls of a program).
_SMALL = 64
#: Whether ``array('i')`` packs ids as the wire does (little-endian int32), so a list of ints
#: is packed without numpy.
_ARRAY_IS_WIRE = sys.byteorder == "little" and array.array("i").itemsize == 4


def check_loaded_adapter(lora_name: str | None, loaded: frozenset[str]) -> None:
    """Raise `UnknownAdapter` (listing what is loaded) unless `lora_name` is None or loaded."""
    if lora_name is not None and lora_name not in loaded:
        served = sorted(loaded)
        raise UnknownAdapter(
            f"LoRA adapter {lora_name!r} is not loaded; loaded: {', '.join(served) or 'none'}",
            adapter=lora_name, served=served,
        )  # fmt: skip


def check_prompt(token_ids: Any, vocab_size: int, max_tokens: int = 0) -> np.ndarray:
    """Validate a prompt and return it as an int32 array.

    Args:
        token_ids: a sequence of ints (list, tuple, numpy or torch integer array).
        vocab_size: ids must lie in ``[0, vocab_size)``.
        max_tokens: the longest prompt allowed; 0 means no limit.

    Raises:
        EmptyPrompt, TokenOutOfVocabulary, PromptTooLong: each with the offending values.
    """
    try:
        ids = np.asarray(token_ids)
    except (TypeError, ValueError) as exc:
        raise TokenOutOfVocabulary(f"token ids are not a sequence of integers: {exc}") from None
    if ids.ndim != 1:
        raise TokenOutOfVocabulary(f"token ids must be a flat sequence, got shape {ids.shape}")
    if ids.size == 0:
        raise EmptyPrompt("the prompt has no tokens (an empty text encodes to none)")
    if ids.dtype.kind not in "iu":
        if ids.dtype.kind == "O" and all(_is_int(t) for t in ids):
            ids = ids.astype(np.int64)
        else:
            raise TokenOutOfVocabulary(f"token ids must be integers, got {ids.dtype} values")
    small_list = isinstance(token_ids, list) and ids.size <= _SMALL  # reduced as it is
    _check_ids(token_ids if small_list else ids, vocab_size, max_tokens)
    return ids.astype(np.int32, copy=False)


def prompt_bytes(token_ids: Any, vocab_size: int, max_tokens: int = 0) -> bytes:
    """`check_prompt`, then the prompt as the wire carries it (little-endian int32 bytes).

    A short list of plain ints, what a program passes on nearly every call, is checked and
    packed without numpy (1.8 against 3.2 us a call here, timed with ``timeit``: the client's
    loop pays it for every call); anything else, and every prompt that fails, goes through
    `check_prompt`, which raises the typed error.
    """
    if (
        _ARRAY_IS_WIRE
        and type(token_ids) is list
        and 0 < len(token_ids) <= _SMALL
        and (not max_tokens or len(token_ids) <= max_tokens)
        and all(type(token) is int for token in token_ids)
        and min(token_ids) >= 0
        and max(token_ids) < vocab_size
    ):
        return array.array("i", token_ids).tobytes()
    return ids_to_bytes(check_prompt(token_ids, vocab_size, max_tokens))


def check_token_bytes(token_bytes: bytes, vocab_size: int, max_tokens: int = 0) -> None:
    """`check_prompt` of a prompt as the wire carries it (little-endian int32 bytes, whole
    ids: `shared.wire` checked the length), without converting a sequence of any type first.

    Raises:
        EmptyPrompt, TokenOutOfVocabulary, PromptTooLong: as `check_prompt` does.
    """
    if len(token_bytes) < 4:
        raise EmptyPrompt("the prompt has no tokens (an empty text encodes to none)")
    _check_ids(np.frombuffer(token_bytes, dtype="<i4"), vocab_size, max_tokens)


def token_bytes_pass(prompts: Sequence[bytes], vocab_size: int, max_tokens: int = 0) -> bool:
    """Whether every one of `prompts` (wire bytes, as `check_token_bytes` takes them) passes
    `check_token_bytes`, checked at once: each one's length, then one array of all their
    tokens and one minimum and maximum (numpy dispatches each reduction in a few us: a worker
    checking each request's prompt alone paid them for every request). False says only that
    one fails: check each to learn which, and why."""
    limit = max_tokens * 4
    if any(len(tokens) < 4 or (limit and len(tokens) > limit) for tokens in prompts):
        return False
    if not prompts:
        return True
    ids = np.frombuffer(b"".join(prompts), dtype="<i4")
    return bool(ids.min() >= 0 and ids.max() < vocab_size)


def _check_ids(ids: Any, vocab_size: int, max_tokens: int) -> None:
    """Range and length of a non-empty integer array of ids (or a list of at most `_SMALL`)."""
    size = len(ids)
    if size <= _SMALL:  # numpy's reductions cost ~3 us each to dispatch; a list's do not
        small = ids if isinstance(ids, list) else ids.tolist()
        lo, hi = int(min(small)), int(max(small))
    else:
        lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise TokenOutOfVocabulary(
            f"token id {bad} is outside the vocabulary [0, {vocab_size})",
            token_id=bad,
            vocab_size=vocab_size,
        )
    if max_tokens and size > max_tokens:
        raise PromptTooLong(
            f"prompt of {size} tokens exceeds the limit of {max_tokens}",
            length=int(size),
            limit=max_tokens,
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
