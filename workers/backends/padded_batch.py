"""`run_rows`: forward passes over rows that each bring a stored past and new tokens.

A forward lays its rows out as one padded batch (`batch_inputs`), gathers their pasts from the
`KvPool` into the cache it hands the model and puts the new positions back (`pool_cache`), and
returns float32 log-probabilities in one device-to-host copy: the tensor operations of a
forward are a constant plus a constant per layer, whatever the rows or the segments of their
pasts (`lmq bench forward` counts them). A batch out of memory is split in halves.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lmqueue.shared.errors import ModelError

from .batch_inputs import BatchInputs, Row, attention_mask
from .kv_pool import KvPool
from .pool_cache import KvLayoutMismatch, past_cache, store_new

if TYPE_CHECKING:
    from .lora_batch import BatchedLora

__all__ = [
    "ForwardStats",
    "KvLayoutMismatch",
    "Output",
    "Row",
    "device_forward",
    "forward_options",
    "kv_argument",
    "model_error",
    "padded_forward",
    "plain_forward",
    "run_rows",
    "to_host",
]

logger = logging.getLogger(__name__)

#: What one row yields: its log-probabilities (a row of its forward's output), or the error.
Output = torch.Tensor | BaseException


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
    #: Batches run as two forwards, narrow rows first (`ShapeSplit`).
    shape_splits: int = 0
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

    def count_shape_split(self) -> None:
        """A batch run as two forwards by the shape of its rows."""
        with self._lock:
            self.shape_splits += 1


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
    pool: KvPool | None,
    forward_kwargs: dict[str, Any],
    stats: ForwardStats,
    lora: BatchedLora | None = None,
    replay: Callable[[list[Row]], torch.Tensor | None] | None = None,
) -> list[Output]:
    """One output per row, each under its row's adapter from `lora`; a batch out of memory is
    split in halves and retried. A row's output is a view of its forward's output tensor.
    `replay` runs the rows from a captured graph if it can (`DecodeGraphs.run`; None: it
    cannot, and they run eagerly).

    Any other error, or out-of-memory on a single row, becomes the output of exactly the rows
    of that forward: the caller fails their queries and goes on serving. `KvLayoutMismatch`
    is raised: the caller must drop the pool and run again.
    """
    started = time.perf_counter()
    try:
        logprobs = replay(rows) if replay is not None else None
        if logprobs is None:
            logprobs = padded_forward(model, rows, pool, forward_kwargs, lora)
    except KvLayoutMismatch:
        raise
    except Exception as exc:
        if not _is_oom(exc) or len(rows) == 1:
            logger.error("forward pass of %d rows failed", len(rows), exc_info=exc)
            return [exc] * len(rows)
        stats.count_split()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        half = len(rows) // 2
        head = run_rows(model, rows[:half], pool, forward_kwargs, stats, lora)
        return head + run_rows(model, rows[half:], pool, forward_kwargs, stats, lora)
    stats.count(rows, time.perf_counter() - started)
    return list(logprobs.unbind(0))


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc)
    )


def padded_forward(
    model: Any,
    rows: list[Row],
    pool: KvPool | None,
    forward_kwargs: dict[str, Any],
    lora: BatchedLora | None = None,
) -> torch.Tensor:
    """Run `rows` as one batch, each row under its adapter from `lora` (inputs ``[rows, N]``);
    with a `pool`, pasts are read from it and new positions written to it (rows' `dest`).

    Returns:
        The ``(len(rows), vector_size)`` float32 log-probabilities on the CPU (pinned memory
        when the model is on a GPU).
    """
    device = pool.kv.device if pool is not None else model.get_input_embeddings().weight.device
    width_past = max(row.past_len for row in rows)
    width_new = max(len(row.new_tokens) for row in rows)
    inputs = BatchInputs.of(rows, width_past, width_new, device)
    names = [row.adapter for row in rows]
    with lora.rows(names) if lora is not None else contextlib.nullcontext():
        logprobs = device_forward(model, pool, inputs, len(rows), forward_kwargs)
    return to_host(logprobs)


def device_forward(
    model: Any,
    pool: KvPool | None,
    inputs: BatchInputs,
    count: int,
    forward_kwargs: dict[str, Any],
) -> torch.Tensor:
    """The forward on the device, from inputs there to float32 log-probabilities there (what
    a CUDA graph captures): pasts gathered from `pool`, new positions scattered back."""
    cache = past_cache(pool, inputs, count) if pool is not None else None
    output = model(
        input_ids=inputs.ids,
        attention_mask=attention_mask(model, inputs.real, inputs.width_past, inputs.width_new),
        position_ids=inputs.positions,
        use_cache=cache is not None,
        **{kv_argument(model): cache},
        **forward_kwargs,
    )
    logprobs = torch.log_softmax(output.logits[:, -1].to(torch.float32), dim=-1)
    if cache is not None and inputs.keeps_kv:
        assert pool is not None
        store_new(pool, cache, inputs)
    return logprobs


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the CPU: itself there, else one copy into pinned memory."""
    if tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(tensor.device).synchronize()
    return host
