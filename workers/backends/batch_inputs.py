"""`BatchInputs`: one forward's rows laid out as padded tensors, built on the host in one array.

With B rows, P the longest past and N the longest run of new tokens, the key/value slots are::

    0 .. P-1      each row's past, right-padded (its slots read the pool's zero slot)
    P .. P+N-1    each row's new tokens, left-padded with token 0

so every row's last real token sits in slot P+N-1 and ``logits_to_keep=1`` computes one logit
row per query. Position ids are explicit (``past_len + i`` for the i-th new token). A padding
position's KV goes to the pool's scratch slot, as does the KV of a row that keeps none.

Every id, position and slot index of a forward is packed into one int64 array on the host
(`pack`) and sent in one copy; the device tensors are views of it (`BatchInputs.view`, which
a CUDA graph's static buffer uses too).

The mask. A real token sees the real slots up to its own. A padding token in the new region
sees only itself: with the usual 2-D mask a row without past leaves its padding queries with
no visible key at all, and whether such a row comes out as zeros or NaN depends on the
attention kernel (PyTorch's CPU kernel gives zeros, eager attention gives a uniform average).
A NaN there would be stored as that slot's key and value, and zero attention weight times NaN
is still NaN in every real row. Seeing itself, a padding row stays finite with any kernel. The
mask is passed as 4-D (bool for sdpa, additive float for eager); models with sliding-window
layers or other attention implementations get the 2-D mask, since one 4-D mask would
override their per-layer windows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .kv_pool import SCRATCH_SLOT, ZERO_SLOT

__all__ = ["BatchInputs", "NO_SLOTS", "Row", "attention_mask", "pack"]

NO_SLOTS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Row:
    """One query of a forward.

    Attributes:
        past: the `KvPool` slots of the first `past_len` positions of the prompt, in order.
        new_tokens: the rest of the prompt, to be run now (at least one token).
        adapter: the LoRA adapter the row is computed with (None: the base model).
        dest: the slots its new positions' KV goes to; None keeps none.
    """

    past: np.ndarray
    new_tokens: tuple[int, ...]
    adapter: str | None = None
    dest: np.ndarray | None = None

    @property
    def past_len(self) -> int:
        return len(self.past)

    @classmethod
    def fresh(cls, tokens: tuple[int, ...], adapter: str | None = None) -> Row:
        """A row with no past that keeps no KV."""
        return cls(NO_SLOTS, tokens, adapter)


@dataclass(frozen=True)
class BatchInputs:
    """A forward's inputs on its device, sent in one copy.

    ``ids``, ``positions`` ``(B, N)``; ``gather`` ``(B * (P + N))`` the pool slot each position
    of the forward's KV starts from (a row's past, then the zero slot: the new positions are
    written by the model); ``dest`` ``(B * N)`` the slots the new positions go to; ``real``
    ``(B, P + N)``: which positions are real.
    """

    ids: torch.Tensor
    positions: torch.Tensor
    gather: torch.Tensor
    dest: torch.Tensor
    real: torch.Tensor
    width_past: int
    width_new: int
    keeps_kv: bool

    @classmethod
    def of(cls, rows: Sequence[Row], width_past: int, width_new: int, device: Any) -> BatchInputs:
        """`rows` laid out for one forward of widths `width_past` and `width_new`, on `device`."""
        host, keeps_kv = pack(rows, width_past, width_new)
        sent = torch.from_numpy(host).to(device, non_blocking=True)
        return cls.view(sent, len(rows), width_past, width_new, keeps_kv)

    @classmethod
    def view(
        cls, sent: torch.Tensor, count: int, width_past: int, width_new: int, keeps_kv: bool
    ) -> BatchInputs:
        """The inputs in `sent`, a buffer `pack` filled (a CUDA graph's static buffer too)."""
        parts = sent.split(_sizes(count, width_past, width_new))
        return cls(
            ids=parts[0].view(count, width_new),
            positions=parts[1].view(count, width_new),
            gather=parts[2],
            dest=parts[3],
            real=parts[4].view(count, width_past + width_new).bool(),
            width_past=width_past,
            width_new=width_new,
            keeps_kv=keeps_kv,
        )


def _widths(width_past: int, width_new: int) -> tuple[int, ...]:
    return (width_new, width_new, width_past + width_new, width_new, width_past + width_new)


def _sizes(count: int, width_past: int, width_new: int) -> tuple[int, ...]:
    return tuple(count * width for width in _widths(width_past, width_new))


def pack(rows: Sequence[Row], width_past: int, width_new: int) -> tuple[np.ndarray, bool]:
    """The int64 buffer of a forward's ids, positions, gathered and destination slots and real
    positions (one array: one copy to the device), and whether any row keeps its KV."""
    count = len(rows)
    widths = _widths(width_past, width_new)
    sizes = _sizes(count, width_past, width_new)
    host = np.zeros(sum(sizes), dtype=np.int64)
    ids, positions, gather, dest, real = (
        view.reshape(count, width)
        for view, width in zip(np.split(host, np.cumsum(sizes)[:-1]), widths, strict=True)
    )
    gather[:] = ZERO_SLOT
    dest[:] = SCRATCH_SLOT
    keeps_kv = False
    for b, row in enumerate(rows):
        start = width_new - len(row.new_tokens)
        ids[b, start:] = row.new_tokens
        positions[b, start:] = np.arange(row.past_len, row.past_len + len(row.new_tokens))
        gather[b, : row.past_len] = row.past
        if row.dest is not None:
            dest[b, start:] = row.dest
            keeps_kv = True
        real[b, : row.past_len] = 1
        real[b, width_past + start :] = 1
    return host, keeps_kv


def attention_mask(model: Any, real: torch.Tensor, width_past: int, width_new: int) -> Any:
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
