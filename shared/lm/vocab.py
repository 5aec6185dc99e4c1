"""`decode_vocab`: the exact bytes of every token of a HuggingFace tokenizer.

Tokenizers store tokens as strings in one of two encodings. GPT-2 style byte-level BPE maps
each byte to a printable character (`_BYTE_LEVEL_DECODER` inverts that map); SentencePiece
spells a space as ``▁`` and unrepresentable bytes as ``<0xNN>``. Which one applies is read from
the tokenizer's own decoder description, not guessed from the vocabulary. Added (special)
tokens are stored verbatim and become their UTF-8 bytes.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from .tokens import Token

__all__ = ["decode_vocab", "byte_vocab_of", "str_vocab_of", "vocab_digest", "VocabularyError"]

_SP_SPACE = "\u2581"
_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class VocabularyError(ValueError):
    """Raised when a tokenizer's token encoding cannot be determined or does not round-trip."""


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 stays, the rest shifts up."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in alphabet:
            alphabet[b] = chr(256 + shifted)
            shifted += 1
    return alphabet


_BYTE_LEVEL_DECODER = {char: byte for byte, char in _byte_level_alphabet().items()}


def decode_vocab(tokenizer: Any) -> tuple[list[Token], list[str]]:
    """Return ``(byte_vocab, str_vocab)`` for a HuggingFace tokenizer.

    ``byte_vocab[i]`` is a `Token` with ``token_id == i`` holding the exact bytes token ``i``
    contributes to decoded text. ``str_vocab[i]`` is those bytes as UTF-8, or, for byte
    fragments that are not valid UTF-8, the tokenizer's own spelling of the token.

    Raises:
        VocabularyError: if the tokenizer's encoding is neither byte-level nor SentencePiece.
    """
    raw = byte_vocab_of(tokenizer)
    byte_vocab = [Token(i, b) for i, b in enumerate(raw)]
    return byte_vocab, str_vocab_of(raw, tokenizer)


def byte_vocab_of(tokenizer: Any) -> list[bytes]:
    """The bytes of every token id in ``range(len(tokenizer))``."""
    kinds = _decoder_kinds(tokenizer)
    added = {token_id: text for text, token_id in tokenizer.get_added_vocab().items()}
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    if kinds & {"ByteFallback", "Metaspace"} or (not kinds and hasattr(tokenizer, "sp_model")):
        convert = _sentencepiece_bytes
    elif "ByteLevel" in kinds or not kinds:
        convert = _byte_level_bytes
    else:
        raise VocabularyError(f"cannot read token bytes through decoder {sorted(kinds)}")
    vocab = []
    for token_id, piece in enumerate(pieces):
        if token_id in added:
            vocab.append(added[token_id].encode("utf-8"))
        elif piece is None:
            raise VocabularyError(f"token id {token_id} has no spelling in the tokenizer")
        else:
            vocab.append(convert(piece, token_id))
    return vocab


def str_vocab_of(byte_vocab: list[bytes], tokenizer: Any = None) -> list[str]:
    """UTF-8 text of each token; the tokenizer's spelling (or U+FFFD) for partial characters."""
    strings = []
    for token_id, raw in enumerate(byte_vocab):
        try:
            strings.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            if tokenizer is not None:
                strings.append(tokenizer.convert_ids_to_tokens(token_id))
            else:
                strings.append(raw.decode("utf-8", errors="replace"))
    return strings


def vocab_digest(byte_vocab: list[bytes]) -> str:
    """A short digest of a byte vocabulary: equal digests mean equal trie node numbering."""
    digest = hashlib.blake2b(digest_size=12)
    for token in byte_vocab:
        digest.update(len(token).to_bytes(4, "little"))
        digest.update(bytes(token))
    return digest.hexdigest()


def _byte_level_bytes(piece: str, token_id: int) -> bytes:
    try:
        return bytes(_BYTE_LEVEL_DECODER[char] for char in piece)
    except KeyError as exc:
        raise VocabularyError(
            f"token {token_id} ({piece!r}) has character {exc.args[0]!r} outside the byte-level"
            " alphabet"
        ) from None


def _sentencepiece_bytes(piece: str, token_id: int) -> bytes:
    whole = _SP_BYTE.fullmatch(piece)
    if whole:
        return bytes([int(whole.group(1), 16)])
    return piece.replace(_SP_SPACE, " ").encode("utf-8")


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """The type names in a fast tokenizer's decoder description (empty for slow tokenizers)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    kinds: set[str] = set()
    stack = [json.loads(backend.to_str()).get("decoder")]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                kinds.add(node["type"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return kinds
