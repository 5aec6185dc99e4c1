"""Partitions of a model's request streams: which one a prompt goes to, which worker owns it.

Why partitions. A worker that has seen a prompt holds its KV (the hf backend's prefix cache),
so the next call of the same lineage (an SMC particle one token longer) costs one token there
and the whole prompt anywhere else. With one stream and several workers, a lineage's calls
scatter over the fleet and KV reuse fades as it grows. Splitting the stream into N partitions,
choosing a request's partition from its prompt, and letting each worker prefer the partitions
it owns keeps a lineage on one worker (prefix affinity, as sglang-router and vLLM's
production-stack route by prefix).

Choosing a partition (clients; `Partitioning`): the hash of the prompt's leading block of
``block_tokens`` tokens, so every continuation of a prompt and every particle of one program
lands on one partition. A prompt shorter than the block is hashed whole; its continuations
would then hop until they reach the block, so a client also remembers the partition of the
prompts it sent recently (`LineageMemory`) and sends a prompt whose recent ancestor (up to
`MAX_STEP_TOKENS` tokens shorter) it sent to the ancestor's partition.

A LoRA adapter's requests are hashed with the adapter's name as a salt: a worker's KV of a
prompt under one adapter is of no use to the same prompt under another, so lineages of
different adapters are spread independently.

Owning partitions (workers; `assign_partitions`): rendezvous hashing with bounded load over
the live workers' names: each partition goes to its highest-scoring worker that holds fewer
than ceil(N / W) partitions. Every worker computes the same table from the same live set, so
ownership needs no coordination; a joining or leaving worker moves about N / W partitions.
Ownership is a preference, not a lock: the consumer group still delivers each entry once, and
an idle worker takes entries from partitions it does not own (work stealing), so a dead
owner's partitions never starve and a hot partition is shared.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from .prompt_key import PromptKey

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "MAX_STEP_TOKENS",
    "LineageMemory",
    "adapter_salt",
    "Partitioning",
    "assign_partitions",
    "owned_partitions",
    "stream_partitions",
    "block_partition",
]

#: Leading tokens hashed to choose a partition: past typical short preambles, well within
#: the ~100-token prompts of SMC programs.
DEFAULT_BLOCK_TOKENS = 32
#: How many tokens shorter than a prompt its remembered ancestor may be (SMC adds one token a
#: step; multi-token steps add a few).
MAX_STEP_TOKENS = 8
_TOKEN_BYTES = 4


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


class LineageMemory:
    """The partitions of the prompts one client sent recently (least recently used evicted).

    A prompt is remembered by Python's own hash of its bytes (8 bytes a prompt, not the
    prompt): this memory never leaves the process, so the hash need not be stable across
    processes, and a collision could only send a prompt to another partition (a preference,
    like `adapter_salt`'s). A keyed digest cost a client ~7% of its CPU on a cluster, where up
    to ``MAX_STEP_TOKENS + 2`` are taken for a prompt no ancestor of which was sent.
    """

    def __init__(self, capacity: int = 65_536) -> None:
        self.capacity = capacity
        self._partitions: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._partitions)

    def ancestor(self, token_bytes: bytes, salt: bytes = b"") -> int | None:
        """The partition of the prompt itself if sent before (a resubmission), else of its
        longest remembered prefix up to MAX_STEP_TOKENS shorter (under the same `salt`)."""
        length = len(token_bytes) // _TOKEN_BYTES
        salted = salt + token_bytes if salt else token_bytes
        start = len(salt)
        for step in range(0, min(MAX_STEP_TOKENS, length - 1) + 1):
            key = hash(salted[: start + (length - step) * _TOKEN_BYTES])
            partition = self._partitions.get(key)
            if partition is not None:
                self._partitions.move_to_end(key)
                return partition
        return None

    def remember(self, token_bytes: bytes, partition: int, salt: bytes = b"") -> None:
        """Remember that `token_bytes` (under `salt`) went to `partition`."""
        key = hash(salt + token_bytes if salt else token_bytes)
        self._partitions[key] = partition
        self._partitions.move_to_end(key)
        while len(self._partitions) > self.capacity:
            self._partitions.popitem(last=False)


class Partitioning:
    """Chooses the partition of a prompt, for one client of one model.

    Args:
        count: the model's number of partitions (published by its workers).
        block_tokens: how many leading tokens are hashed.
    """

    def __init__(self, count: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        if count < 1 or block_tokens < 1:
            raise ValueError("count and block_tokens must be positive")
        self.count = count
        self.block_tokens = block_tokens
        self.memory = LineageMemory() if count > 1 else None

    def of(self, prompt: PromptKey) -> int:
        """The partition of a prompt (its tokens, under its adapter)."""
        if self.memory is None:
            return 0
        token_bytes, salt = prompt.tokens, adapter_salt(prompt.adapter)
        partition = self.memory.ancestor(token_bytes, salt)
        if partition is None:
            partition = block_partition(token_bytes, self.count, self.block_tokens, salt)
        self.memory.remember(token_bytes, partition, salt)
        return partition


def adapter_salt(adapter: str | None) -> bytes:
    """What prefixes a prompt's bytes when hashed under `adapter` (nothing for the base).

    A collision could only move a lineage to another partition (a preference), never change a
    result: results are keyed on the adapter everywhere else.
    """
    return b"" if adapter is None else adapter.encode() + b"\0"


def stream_partitions(count: int) -> list[int | None]:
    """The partition argument of each request stream of a model with `count` partitions
    (`shared.keys.KeySpace.requests`): None for the one stream of an unpartitioned model."""
    return [None] if count <= 1 else list(range(count))


def block_partition(token_bytes: bytes, count: int, block_tokens: int, salt: bytes = b"") -> int:
    """The partition of the hash of the leading `block_tokens` tokens (stateless)."""
    block = salt + token_bytes[: block_tokens * _TOKEN_BYTES]
    return int.from_bytes(_digest(block)[:8], "little") % count


def _score(worker: str, partition: int) -> int:
    return int.from_bytes(_digest(f"{worker}\0{partition}".encode())[:8], "little")


def assign_partitions(workers: Iterable[str], count: int) -> list[str]:
    """The owner of each of `count` partitions among `workers` (same input, same table).

    Rendezvous hashing with bounded load: partitions, taken in order, go to their
    highest-scoring worker that still holds fewer than ceil(count / workers).
    """
    names = sorted(set(workers))
    if not names:
        return []
    cap = math.ceil(count / len(names))
    held = dict.fromkeys(names, 0)
    owners = []
    for partition in range(count):
        ranked = sorted(names, key=lambda w: _score(w, partition), reverse=True)
        owner = next(w for w in ranked if held[w] < cap)
        held[owner] += 1
        owners.append(owner)
    return owners


def owned_partitions(worker: str, workers: Sequence[str], count: int) -> frozenset[int]:
    """The partitions `worker` owns when `workers` (which it joins) are live."""
    owners = assign_partitions([*workers, worker], count)
    return frozenset(p for p, owner in enumerate(owners) if owner == worker)
