"""`run_rows`: forward passes over rows that each bring a stored past and new tokens.

With B rows, P the longest past and N the longest run of new tokens, the key/value slots are::

    0 .. P-1      each row's past, right-padded with zero KV
    P .. P+N-1    each row's new tokens, left-padded with token 0

so every row's last real token sits in slot P+N-1 and ``logits_to_keep=1`` computes one logit
row per query. Position ids are explicit (``past_len + i`` for the i-th new token).

The mask. A real token sees the real slots up to its own. A padding token in the new region
sees only itself: with the usual 2-D mask a row without past leaves its padding queries with
no visible key at all, and whether such a row comes out as zeros or NaN depends on the
attention kernel (PyTorch's CPU kernel gives zeros, eager attention gives a uniform average).
A NaN there is stored as that slot's key and value, and zero attention weight times NaN is
still NaN in every real row. Seeing itself, a padding row stays finite with any kernel. The
mask is passed as 4-D (bool for sdpa, additive float for eager); models with sliding-window
layers or other attention implementations get the 2-D mask, since one 4-D mask would
override their per-layer windows.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lmqueue.shared.errors import ModelError

if TYPE_CHECKING:
    from .lora_batch import BatchedLora

__all__ = [
    "STAGING_GROWTH",
    "ForwardStats",
    "Output",
    "Row",
    "forward_options",
    "kv_argument",
    "model_error",
    "padded_forward",
    "plain_forward",
    "run_rows",
]

logger = logging.getLogger(__name__)

#: What one row yields: its log-probabilities and the KV segment of its new tokens, or the error.
Output = tuple[torch.Tensor, "torch.Tensor | None"] | BaseException


@dataclass
class ForwardStats:
    """Counters of the work done, for tests and benchmarks (written by the forward threads)."""

    forwards: int = 0
    rows: int = 0
    new_tokens: int = 0
    #: Prompt positions whose KV came from the prefix cache instead of being computed.
    reused_tokens: int = 0
    forward_s: float = 0.0
    oom_splits: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, rows: list[Row], seconds: float) -> None:
        """One forward of `rows` that took `seconds` (forwards may end on several threads)."""
        with self._lock:
            self.forwards += 1
            self.rows += len(rows)
            self.new_tokens += sum(len(row.new_tokens) for row in rows)
            self.reused_tokens += sum(row.past_len for row in rows)
            self.forward_s += seconds

    def count_split(self) -> None:
        """A forward out of memory, retried as two halves."""
        with self._lock:
            self.oom_splits += 1


@dataclass(frozen=True)
class Row:
    """One query of a forward.

    Attributes:
        past: KV segments ``(layers, 2, kv_heads, tokens, head_dim)`` covering the first
            `past_len` positions of the prompt, in order.
        past_len: positions covered by `past`.
        new_tokens: the rest of the prompt, to be run now (at least one token).
    """

    past: list[torch.Tensor]
    past_len: int
    new_tokens: tuple[int, ...]
    #: The LoRA adapter the row is computed with (None: the base model).
    adapter: str | None = None


def forward_options(model: Any) -> dict[str, Any]:
    """``logits_to_keep=1`` where the model takes it: only the last position's logits."""
    takes = "logits_to_keep" in inspect.signature(model.forward).parameters
    return {"logits_to_keep": 1} if takes else {}


def kv_argument(model: Any) -> str:
    """The name under which `model`'s forward takes and returns its KV cache.

    transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns and goes in
    5.40); older releases know only ``past_key_values``. The forward's own signature says which
    (``inspect.signature`` follows the deprecation decorator to the real function), and the
    output field carries the same name, so this is the one place that decides.
    """
    return _kv_argument_of(model.__class__)


@functools.cache
def _kv_argument_of(model_class: Any) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def model_error(exc: BaseException) -> ModelError:
    """A `ModelError` describing `exc`, chained to it."""
    error = ModelError(f"forward pass failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def plain_forward(model: Any, tokens: tuple[int, ...], options: dict[str, Any]) -> torch.Tensor:
    """Log-probabilities after `tokens` from one unpadded forward without cache (the reference)."""
    ids = torch.tensor([tokens], device=model.get_input_embeddings().weight.device)
    logits = model(input_ids=ids, use_cache=False, **options).logits
    return torch.log_softmax(logits[0, -1].to(torch.float32), dim=-1).cpu()


def run_rows(
    model: Any,
    rows: list[Row],
    keep_kv: bool,
    forward_kwargs: dict[str, Any],
    stats: ForwardStats,
    lora: BatchedLora | None = None,
) -> list[Output]:
    """One output per row, each under its row's adapter from `lora`; a batch out of memory is
    split in halves and retried.

    Any other error, or out-of-memory on a single row, becomes the output of exactly the rows
    of that forward: the caller fails their queries and goes on serving.
    """
    started = time.perf_counter()
    try:
        logprobs, segments = padded_forward(model, rows, keep_kv, forward_kwargs, lora)
    except Exception as exc:
        if not _is_oom(exc) or len(rows) == 1:
            logger.error("forward pass of %d rows failed", len(rows), exc_info=exc)
            return [exc] * len(rows)
        stats.count_split()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        half = len(rows) // 2
        head = run_rows(model, rows[:half], keep_kv, forward_kwargs, stats, lora)
        return head + run_rows(model, rows[half:], keep_kv, forward_kwargs, stats, lora)
    stats.count(rows, time.perf_counter() - started)
    # Each row copied out: a view would keep the whole batch's vectors alive in the cache.
    return [(logprobs[i].clone(), segments[i]) for i in range(len(rows))]


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc)
    )


def padded_forward(
    model: Any,
    rows: list[Row],
    keep_kv: bool,
    forward_kwargs: dict[str, Any],
    lora: BatchedLora | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Run `rows` as one batch, each row under its adapter from `lora` (inputs ``[rows, N, d]``).

    Returns:
        The ``(len(rows), vector_size)`` float32 log-probabilities on the CPU, and per row the
        KV segment of its new tokens (None when `keep_kv` is false or the model's KV layers
        cannot be stacked into one tensor).
    """
    device = model.get_input_embeddings().weight.device
    width_past = max(row.past_len for row in rows)
    width_new = max(len(row.new_tokens) for row in rows)
    ids, positions, real = _inputs(rows, width_past, width_new)
    past = _past_cache(rows, width_past, width_new) if keep_kv else None
    kv_name = kv_argument(model)
    names = [row.adapter for row in rows]
    with lora.rows(names) if lora is not None else contextlib.nullcontext():
        output = model(
            input_ids=ids.to(device),
            attention_mask=_attention_mask(model, real.to(device), width_past, width_new),
            position_ids=positions.to(device),
            use_cache=keep_kv,
            **{kv_name: past},
            **forward_kwargs,
        )
    logprobs = torch.log_softmax(output.logits[:, -1].to(torch.float32), dim=-1).cpu()
    if not keep_kv:
        return logprobs, [None] * len(rows)
    return logprobs, _new_segments(getattr(output, kv_name), rows, width_past)


def _inputs(rows: list[Row], width_past: int, width_new: int) -> tuple[torch.Tensor, ...]:
    """Token ids and position ids ``(B, N)``, and which of the ``P + N`` slots are real."""
    ids = torch.zeros((len(rows), width_new), dtype=torch.long)
    positions = torch.zeros((len(rows), width_new), dtype=torch.long)
    real = torch.zeros((len(rows), width_past + width_new), dtype=torch.bool)
    for b, row in enumerate(rows):
        start = width_new - len(row.new_tokens)
        ids[b, start:] = torch.tensor(row.new_tokens)
        positions[b, start:] = torch.arange(row.past_len, row.past_len + len(row.new_tokens))
        real[b, : row.past_len] = True
        real[b, width_past + start :] = True
    return ids, positions, real


def _attention_mask(model: Any, real: torch.Tensor, width_past: int, width_new: int) -> Any:
    """The mask the model's attention implementation takes (see the module docstring)."""
    config = model.config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("sdpa", "eager") or _has_sliding_window(config):
        return real.long()
    query_slots = torch.arange(width_new, device=real.device)[:, None] + width_past
    key_slots = torch.arange(width_past + width_new, device=real.device)[None, :]
    visible = (key_slots <= query_slots)[None] & real[:, None, :]
    padding_queries = ~real[:, width_past:, None]
    visible |= padding_queries & (key_slots == query_slots)[None]
    if implementation == "sdpa":
        return visible[:, None]
    dtype = model.dtype
    blocked = torch.full(visible.shape, torch.finfo(dtype).min, dtype=dtype, device=real.device)
    return blocked.masked_fill(visible, 0.0)[:, None]


def _has_sliding_window(config: Any) -> bool:
    text = config.get_text_config()
    layer_types = getattr(text, "layer_types", None) or ()
    windowed = getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)
    return bool(windowed) or any(kind != "full_attention" for kind in layer_types)


def _past_cache(rows: list[Row], width_past: int, width_new: int) -> Any:
    """The rows' pasts, right-padded with zeros, as a per-layer cache holding one copy.

    Each layer gets a block with room for the new positions too (keys and values are its two
    halves), and the model's attention writes the new positions into it (`_layer_class`)
    where the stock layer would concatenate past and new into a fresh tensor every forward.
    The blocks are views of one ``(layers, 2, rows, heads, P + N, head_dim)`` tensor that the
    forward thread keeps for its next forwards (`_KvStaging`): allocated anew, its ~5 MiB a
    row were fresh pages every forward (SmolLM2 at 113 positions, 32 rows: 165 MiB), and the
    page faults cost the worker a third of its CPU (BENCHMARKS.md 10).

    A row's past is a chain of trie segments, one per query that extended it (an SMC particle
    24 steps in has ~25), and particles share their first segments. Each segment is copied
    once for all its layers, and once for a run of adjacent rows that share it (the
    prompt's, for every particle of a program) by broadcasting: no per-row concatenation.
    """
    from transformers import DynamicCache  # imported here: `workers.backends` stays light

    cache = DynamicCache()
    if width_past == 0:
        return cache
    example = next(row.past[0] for row in rows if row.past)
    layers, _, heads, _, head_dim = example.shape
    shape = (layers, 2, len(rows), heads, width_past + width_new, head_dim)
    # not zeroed: every slot is written once, real positions by a copy, padding by a fill,
    # new positions by the model
    kv = _staging.block(shape, example)
    for segment, first, last, start in _shared_runs(rows):
        end = start + segment.shape[3]
        kv[:, :, first : last + 1, :, start:end] = segment.unsqueeze(2)
    for b, row in enumerate(rows):
        if row.past_len < width_past:
            kv[:, :, b, :, row.past_len : width_past] = 0  # masked out; never garbage (NaN*0)
    layer_class = _layer_class()
    cache.layers.extend(layer_class(kv[layer], width_past) for layer in range(layers))
    return cache


def _shared_runs(rows: list[Row]) -> list[tuple[torch.Tensor, int, int, int]]:
    """``(segment, first row, last row, start position)``: each segment of the rows' pasts with
    the run of adjacent rows holding that same segment object at the same position."""
    runs: list[tuple[torch.Tensor, int, int, int]] = []
    open_runs: dict[tuple[int, int], int] = {}  # (segment id, start) -> index in `runs`
    for b, row in enumerate(rows):
        start = 0
        for segment in row.past:
            key = (id(segment), start)  # the rows hold every segment: ids are not reused
            index = open_runs.get(key)
            if index is not None and runs[index][2] == b - 1:
                runs[index] = (segment, runs[index][1], b, start)
            else:
                open_runs[key] = len(runs)
                runs.append((segment, b, b, start))
            start += segment.shape[3]
    return runs


class _KvStaging(threading.local):
    """Each forward thread's tensor for its forwards' past KV, kept from one to the next.

    A forward's KV views of it are gone when the forward returns (the new positions' KV is
    cloned out by `_new_segments`), so the thread's next forward may overwrite it. It is
    replaced when too small, and when more than `_STAGING_SPARE` times what a forward needs (a
    batch of long prompts does not keep its size for good, while batches of 16 and 32 rows in
    turn share one); it grows with `STAGING_GROWTH` to spare, so pasts growing by a token a
    step do not replace it every forward (memory: one copy of the largest forward's past,
    plus that spare, per forward thread). CPU only: a CUDA caching allocator already reuses
    its blocks.
    """

    buffer: torch.Tensor | None = None

    def block(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """An uninitialised tensor of `shape`, with `like`'s dtype and device."""
        if like.device.type != "cpu":
            return like.new_empty(shape)
        needed = math.prod(shape)
        held = self.buffer
        if (
            held is None
            or held.dtype != like.dtype
            or not needed <= held.numel() <= _STAGING_SPARE * needed + _STAGING_SLACK
        ):
            self.buffer = None  # the old one freed before the new one is allocated
            self.buffer = held = like.new_empty(needed + int(needed * STAGING_GROWTH))
        return held[:needed].view(shape)


#: What a new staging tensor holds beyond the forward's need, as a fraction of it.
STAGING_GROWTH = 1 / 16
#: A staging tensor is kept while it holds at most this many times a forward's need ...
_STAGING_SPARE = 4
#: ... plus this many elements (so that small forwards keep it too).
_STAGING_SLACK = 1 << 20
_staging = _KvStaging()


@functools.cache
def _layer_class() -> type:
    """A `DynamicLayer` that fills a preallocated block instead of concatenating."""
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """Keys and values are views of ``block[0]`` and ``block[1]`` up to the filled slot."""

        def __init__(self, block: torch.Tensor, filled: int) -> None:
            super().__init__()
            self.block, self.filled = block, filled
            self.dtype, self.device = block.dtype, block.device
            self.keys, self.values = block[0, :, :, :filled], block[1, :, :, :filled]
            self.is_initialized = True

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            end = self.filled + key_states.shape[-2]
            if end > self.block.shape[3]:  # more than the forward was sized for: grow as usual
                return super().update(key_states, value_states, *args, **kwargs)
            self.block[0, :, :, self.filled : end] = key_states
            self.block[1, :, :, self.filled : end] = value_states
            self.filled = end
            self.keys, self.values = self.block[0, :, :, :end], self.block[1, :, :, :end]
            return self.keys, self.values

    return PreallocatedLayer


def _new_segments(cache: Any, rows: list[Row], width_past: int) -> list[torch.Tensor | None]:
    """Each row's KV of its new tokens, all layers in one tensor (copied out of the batch)."""
    try:
        new = torch.stack(
            [
                torch.stack((layer.keys[:, :, width_past:], layer.values[:, :, width_past:]))
                for layer in cache.layers
            ]
        )
    except (RuntimeError, AttributeError) as exc:  # layers of unequal shape or device
        logger.warning("KV of this model cannot be kept as one tensor per segment: %s", exc)
        return [None] * len(rows)
    width_new = new.shape[4]
    return [
        new[:, :, b, :, width_new - len(row.new_tokens) :].clone() for b, row in enumerate(rows)
    ]
