"""The KV cache a forward hands the model: its rows' pasts gathered from the `KvPool`.

One tensor ``(layers, 2, rows, kv_heads, P + N, head_dim)`` holds every layer's keys and values
for the forward: the pasts are gathered into its first P positions from the pool with one
``index_select`` (by the rows x P slot index of `BatchInputs`) and one copy, the model's
attention writes the new positions into the rest layer by layer (`_layer_class`, where the
stock layer would concatenate past and new into a fresh tensor every forward), and after the
forward the new positions go back to the pool with one ``index_copy_`` (`store_new`). So a
forward's KV costs a constant number of tensor operations, plus two copies per layer.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

import torch

from .batch_inputs import BatchInputs
from .kv_pool import KvPool

__all__ = ["KvLayoutMismatch", "STAGING_GROWTH", "past_cache", "store_new"]


class KvLayoutMismatch(RuntimeError):
    """Raised when a model's attention layers produce KV of another shape than its config says
    (the pool cannot hold it: the backend then runs without KV reuse)."""


def past_cache(pool: KvPool, inputs: BatchInputs, count: int) -> Any:
    """The rows' pasts gathered from `pool`, as a per-layer cache holding one copy.

    The staging tensor is laid out as the pool is, position-major: ``(rows, P + N, layers, 2,
    kv_heads, head_dim)``, so one ``index_select`` writes every row's past straight into it
    (the new positions read the zero slot, overwritten by the model): no intermediate copy,
    no transposition (on a CPU a gather into a temporary and a transposing copy cost 37% of
    SmolLM2's decode forward). A layer's keys are the view ``[:, :, layer, 0]`` transposed to
    ``(rows, kv_heads, P + N, head_dim)``, and the model's attention writes the new positions
    into it (`_layer_class`) where the stock layer would concatenate past and new into a fresh
    tensor every forward. The forward thread keeps the staging tensor for its next forwards on
    a CPU (`_KvStaging`): allocated anew, its pages were fresh every forward and the page
    faults cost a worker a third of its CPU.
    """
    from transformers import DynamicCache  # imported here: `workers.backends` stays light

    layers, kv_heads, head_dim = pool.layout
    width = inputs.width_past + inputs.width_new
    kv = _staging.block((count, width, layers, 2, kv_heads, head_dim), pool.kv)
    torch.index_select(pool.kv, 0, inputs.gather, out=kv.view(-1, layers, 2, kv_heads, head_dim))
    layer_class = _layer_class()
    cache = DynamicCache()
    cache.layers.extend(layer_class(kv[:, :, layer], inputs.width_past) for layer in range(layers))
    cache.staging = kv  # type: ignore[attr-defined]
    return cache


def store_new(pool: KvPool, cache: Any, inputs: BatchInputs) -> None:
    """Scatter the new positions' KV from the staging tensor to the rows' `dest` slots."""
    kv = cache.staging
    new = kv[:, inputs.width_past :]  # (B, N, layers, 2, heads, head_dim)
    pool.kv.index_copy_(0, inputs.dest, new.reshape(-1, *pool.kv.shape[1:]))


class _KvStaging(threading.local):
    """Each forward thread's tensor for its forwards' past KV, kept from one to the next.

    A forward's KV views of it are gone when the forward returns (the new positions' KV is
    scattered to the pool by `store_new`), so the thread's next forward may overwrite it. It is
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
        """Keys and values are views of a layer's staging block ``(rows, P + N, 2, kv_heads,
        head_dim)``, as ``(rows, kv_heads, positions, head_dim)``, up to the filled position."""

        def __init__(self, block: torch.Tensor, filled: int) -> None:
            super().__init__()
            self.all_keys = block[:, :, 0].transpose(1, 2)
            self.all_values = block[:, :, 1].transpose(1, 2)
            self.filled = filled
            self.dtype, self.device = block.dtype, block.device
            self.keys = self.all_keys[:, :, :filled]
            self.values = self.all_values[:, :, :filled]
            self.is_initialized = True

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            room = self.all_keys.shape
            if key_states.shape[1] != room[1] or key_states.shape[3] != room[3]:
                raise KvLayoutMismatch(
                    f"the model's KV is {tuple(key_states.shape)} per layer, the pool's "
                    f"{tuple(room)}"
                )
            end = self.filled + key_states.shape[-2]
            if end > room[2]:  # more than the forward was sized for: grow as usual
                return super().update(key_states, value_states, *args, **kwargs)
            self.all_keys[:, :, self.filled : end] = key_states
            self.all_values[:, :, self.filled : end] = value_states
            self.filled = end
            self.keys, self.values = self.all_keys[:, :, :end], self.all_values[:, :, :end]
            return self.keys, self.values

    return PreallocatedLayer
