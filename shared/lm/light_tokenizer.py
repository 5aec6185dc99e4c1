"""`LightTokenizer`: a HuggingFace tokenizer directory read with the `tokenizers` library alone.

A client needs a tokenizer to encode prompts and decode samples, not a model. Loading one with
transformers' ``AutoTokenizer`` imports torch (~300 MiB of RSS against ~60 MiB here), which a
client process otherwise never needs. This reads ``tokenizer.json`` (the same Rust tokenizer a
fast HuggingFace tokenizer wraps, so ids are identical) and the special tokens of
``tokenizer_config.json``, and answers the calls clients make. Any other attribute
(``apply_chat_template``, ``batch_decode``, ...) loads the full HuggingFace tokenizer from the
same directory on first use and is answered by it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["LightTokenizer"]

_SPECIAL = ("bos", "eos", "pad", "unk")


class LightTokenizer:
    """The common subset of a HuggingFace fast tokenizer's interface, without transformers.

    Raises:
        FileNotFoundError: (from the constructor) if `directory` has no ``tokenizer.json``.
    """

    def __init__(self, directory: Path) -> None:
        from tokenizers import Tokenizer

        self.directory = Path(directory)
        self.backend = Tokenizer.from_file(str(self.directory / "tokenizer.json"))
        config_path = self.directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        for name in _SPECIAL:
            token = config.get(f"{name}_token")
            if isinstance(token, dict):  # AddedToken, serialized
                token = token.get("content")
            setattr(self, f"{name}_token", token)
            setattr(self, f"{name}_token_id", self._id_of(token))
        self._full: Any = None
        self._full_lock = threading.Lock()

    bos_token: str | None
    bos_token_id: int | None
    eos_token: str | None
    eos_token_id: int | None
    pad_token: str | None
    pad_token_id: int | None
    unk_token: str | None
    unk_token_id: int | None

    def _id_of(self, token: Any) -> int | None:
        return self.backend.token_to_id(token) if isinstance(token, str) else None

    def __len__(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (as HuggingFace counts it)."""
        return int(self.backend.get_vocab_size(with_added_tokens=False))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of `text`."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of `token_ids` (special tokens kept unless skipped, as HuggingFace does)."""
        ids = [int(t) for t in token_ids]
        return str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> Any:
        """The vocabulary entry (string) of one id, or of each of a list."""
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        """The id of one vocabulary entry, or of each of a list (None if absent)."""
        if isinstance(tokens, str):
            return self.backend.token_to_id(tokens)
        return [self.backend.token_to_id(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        """Every entry -> id, added tokens included."""
        return dict(self.backend.get_vocab(with_added_tokens=True))

    def get_added_vocab(self) -> dict[str, int]:
        """The added (special) tokens -> id."""
        return {t.content: i for i, t in self.backend.get_added_tokens_decoder().items()}

    def full(self) -> Any:
        """The HuggingFace tokenizer of the same directory (loads transformers, and torch)."""
        with self._full_lock:
            if self._full is None:
                from transformers import AutoTokenizer

                self._full = AutoTokenizer.from_pretrained(str(self.directory))
            return self._full

    def __getattr__(self, name: str) -> Any:
        """Anything not answered here is the full tokenizer's (loaded on first such use)."""
        if name.startswith("_") or name in ("backend", "directory"):
            raise AttributeError(name)
        return getattr(self.full(), name)

    def __repr__(self) -> str:
        return f"LightTokenizer({str(self.directory)!r}, size={len(self)})"
