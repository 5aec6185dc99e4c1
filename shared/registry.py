"""The model registry: what a worker publishes so that clients need no model files.

A worker publishes, per model name, a `ModelInfo` (revision, sizes, limits), its tokenizer as
the files ``save_pretrained`` writes, and its byte vocabulary. It also beats a heartbeat into
the model's worker zset. Clients read all of it once on connect. Publishing is idempotent and
repeated on every heartbeat when the entry is missing, so a Redis restart heals itself.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from .errors import MalformedMessage, UnknownModel
from .keys import KeySpace
from .lm.light_tokenizer import LightTokenizer
from .partitions import DEFAULT_BLOCK_TOKENS
from .wire import WIRE_VERSION

__all__ = [
    "ModelInfo",
    "ModelRegistry",
    "tokenizer_to_files",
    "tokenizer_from_files",
]


@dataclass(frozen=True)
class ModelInfo:
    """Published metadata of a served model."""

    name: str
    revision: str
    backend: str
    #: Number of token ids the tokenizer knows (length of the byte vocabulary).
    vocab_size: int
    #: Length of a log-probability vector (the model's output size, may exceed vocab_size).
    vector_size: int
    max_prompt_tokens: int
    eos_token_ids: list[int] = field(default_factory=list)
    #: Admission bound on queued requests that clients enforce (0: none).
    max_backlog: int = 0
    #: Request stream partitions (1: one stream) and the leading tokens that choose one.
    partitions: int = 1
    partition_block_tokens: int = DEFAULT_BLOCK_TOKENS
    wire_version: int = WIRE_VERSION
    #: The shared cache's URL without credentials when it is a separate instance (empty: the
    #: queue's own). Clients connect there with their own user: one URL per tenant suffices.
    cache_address: str = ""

    def to_bytes(self) -> bytes:
        """Encode as msgpack."""
        return msgpack.packb(asdict(self), use_bin_type=True)

    @classmethod
    def from_bytes(cls, raw: bytes) -> ModelInfo:
        """Decode from msgpack, validating field names and types."""
        values = _unpack(raw, "model info", _MAX_INFO_BYTES, max_map_len=64, max_array_len=4096)
        try:
            info = cls(**values)
        except Exception as exc:
            raise MalformedMessage(f"model info does not decode: {exc}") from None
        sizes = (info.vocab_size, info.vector_size, info.partitions, info.partition_block_tokens)
        if not all(isinstance(size, int) for size in sizes):
            raise MalformedMessage("model info sizes are not integers")
        if info.partitions < 1 or info.partition_block_tokens < 1:
            raise MalformedMessage("model info partitions are not positive")
        return info


#: Info, tokenizer and vocabulary change together (one hash slot in a cluster, `shared.keys`).
_PUBLISH = """
for i = 1, 3 do
  redis.call('SET', KEYS[i], ARGV[i])
end
return 1
"""


class ModelRegistry:
    """Reads and writes the registry keys of `KeySpace` on one Redis connection."""

    def __init__(self, redis: Any, keys: KeySpace) -> None:
        self._redis = redis
        self._keys = keys
        self._publish = redis.register_script(_PUBLISH)

    async def publish(
        self, info: ModelInfo, tokenizer_files: dict[str, bytes], byte_vocab: list[bytes]
    ) -> None:
        """Publish everything a client needs to use `info.name`."""
        keys, name = self._keys, info.name
        await self._publish(
            keys=[keys.model_info(name), keys.model_tokenizer(name), keys.model_vocab(name)],
            args=[
                info.to_bytes(),
                msgpack.packb(tokenizer_files, use_bin_type=True),
                msgpack.packb(list(byte_vocab), use_bin_type=True),
            ],
        )
        # After the entry: a model listed in lmq:models is always readable. A set that names
        # every model cannot share each model's hash slot, so this is a command of its own.
        await self._redis.sadd(keys.models(), name)

    async def is_published(self, name: str) -> bool:
        """Whether the model's info key exists (it vanishes when Redis restarts empty)."""
        return bool(await self._redis.exists(self._keys.model_info(name)))

    async def info(self, name: str) -> ModelInfo:
        """The published info of `name`.

        Raises:
            UnknownModel: if no worker has published it.
        """
        raw = await self._redis.get(self._keys.model_info(name))
        if raw is None:
            known = sorted(m.decode() for m in await self._redis.smembers(self._keys.models()))
            raise UnknownModel(f"no worker has published model {name!r}", model=name, known=known)
        return ModelInfo.from_bytes(raw)

    async def tokenizer_files(self, name: str) -> dict[str, bytes]:
        """The tokenizer files published for `name`."""
        raw = await self._redis.get(self._keys.model_tokenizer(name))
        if raw is None:
            raise UnknownModel(f"model {name!r} has no published tokenizer", model=name)
        files = _unpack(raw, "published tokenizer", _MAX_FILES_BYTES, max_map_len=64)
        if not isinstance(files, dict) or not all(
            isinstance(k, str) and isinstance(v, bytes) for k, v in files.items()
        ):
            raise MalformedMessage("published tokenizer is not a map of file names to bytes")
        return files

    async def byte_vocab(self, name: str) -> list[bytes]:
        """The byte vocabulary published for `name`."""
        raw = await self._redis.get(self._keys.model_vocab(name))
        if raw is None:
            raise UnknownModel(f"model {name!r} has no published vocabulary", model=name)
        vocab = _unpack(raw, "published vocabulary", _MAX_FILES_BYTES, max_array_len=_MAX_VOCAB)
        if not isinstance(vocab, list) or not all(isinstance(t, bytes) for t in vocab):
            raise MalformedMessage("published vocabulary is not a list of bytes")
        return vocab

    async def heartbeat(self, name: str, worker: str) -> None:
        """Record that `worker` serves `name` now."""
        await self._redis.zadd(self._keys.model_workers(name), {worker: int(time.time() * 1000)})

    async def leave(self, name: str, worker: str) -> None:
        """Remove `worker` from the live set of `name` (clean shutdown)."""
        await self._redis.zrem(self._keys.model_workers(name), worker)

    async def live_workers(self, name: str, within_s: float) -> list[str]:
        """Workers of `name` whose last heartbeat is at most `within_s` old."""
        since = int((time.time() - within_s) * 1000)
        members = await self._redis.zrangebyscore(self._keys.model_workers(name), since, "+inf")
        return [m.decode() if isinstance(m, bytes) else m for m in members]


def tokenizer_to_files(tokenizer: Any) -> dict[str, bytes]:
    """The files ``tokenizer.save_pretrained`` writes, by name."""
    with tempfile.TemporaryDirectory(prefix="lmq-tok-") as tmp:
        tokenizer.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}


def tokenizer_from_files(files: dict[str, bytes], cache_dir: Path | None = None) -> Any:
    """Load a tokenizer from `tokenizer_to_files` output, via a content-addressed directory.

    A fast tokenizer (one with ``tokenizer.json``) loads as a `LightTokenizer`, without
    transformers or torch; any other through transformers' ``AutoTokenizer``.

    Safe to call from several threads and processes at once: transformers' lazy imports are
    not (two first imports in two threads can fail with ImportError), so this process's calls
    take turns; the directory is written under a temporary name and renamed into place, so a
    reader never sees half of it.
    """
    for name in files:
        if "/" in name or name.startswith("."):
            raise MalformedMessage(f"tokenizer file name {name!r} is not a plain name")
    digest = hashlib.blake2b(msgpack.packb(sorted(files.items())), digest_size=12).hexdigest()
    base = cache_dir or Path(tempfile.gettempdir()) / "lmqueue-tokenizers"
    target = base / digest
    with _TOKENIZER_LOCK:
        if not target.is_dir():
            base.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{digest}-", dir=base))
            for name, content in files.items():
                (staging / name).write_bytes(content)
            try:
                staging.rename(target)
            except OSError:  # another process renamed its copy first: use that one
                shutil.rmtree(staging, ignore_errors=True)
        if (target / "tokenizer.json").is_file():  # a fast tokenizer: no transformers, no torch
            return LightTokenizer(target)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(target))


#: One tokenizer load at a time in this process (see `tokenizer_from_files`).
_TOKENIZER_LOCK = threading.Lock()


#: Sizes past which a registry value is refused unread: nothing a worker publishes comes near.
_MAX_INFO_BYTES = 64 << 10
_MAX_FILES_BYTES = 64 << 20
_MAX_VOCAB = 1 << 21


def _unpack(raw: bytes, what: str, max_bytes: int, **limits: int) -> Any:
    """Decode a registry value with the wire's caution: size-capped, container-capped, typed.

    Raises:
        MalformedMessage: if `raw` is larger than `max_bytes` or is not valid msgpack within
            `limits` (``max_map_len``, ``max_array_len``).
    """
    if not isinstance(raw, bytes) or len(raw) > max_bytes:
        size = len(raw) if isinstance(raw, bytes) else type(raw).__name__
        raise MalformedMessage(f"{what} of {size} bytes is over the limit of {max_bytes}")
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True, **limits)
    except Exception as exc:  # msgpack raises a zoo of types for garbage input
        raise MalformedMessage(f"{what} does not decode: {type(exc).__name__}: {exc}") from None
