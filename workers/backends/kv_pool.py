"""`KvPool`: every kept position's KV in one tensor per device, addressed by slot.

A slot holds one token position of KV for all layers, keys and values:
``kv[slot]`` is ``(layers, 2, kv_heads, head_dim)``. A prompt's past is a list of slots, in
position order, that need not be contiguous: the prefix trie hands each node the slots of its
edge's positions, a prompt's past is the concatenation along its path, and siblings share
their parents' slots by reference. So a forward assembles any number of rows' pasts with one
gather (``index_select`` by a rows x positions index built on the host as one array) and puts
its new positions back with one scatter (``index_copy_``): a constant number of tensor
operations, whatever the rows or the segments per row (`batch_forward`).

Why one position a slot, not blocks of 16 as in paged attention: attention here reads a
gathered copy, not the pool in place, so a position is addressed individually at no cost, and
an SMC particle extends its past by one token a step. With 16-position blocks every such
one-token node would hold a partial block (15/16 of it wasted, or copied on write when a
sibling extends the same parent); with one-position slots no slot is ever shared partially,
so there is nothing to copy on write and no memory is lost to fragmentation.

Two slots are reserved: `ZERO_SLOT` is all zeros and pads pasts shorter than the longest of a
forward (masked out, but finite: zero weight times NaN would still be NaN); `SCRATCH_SLOT`
takes the KV of padding positions and of rows that keep none, and is never read.

Reuse. A slot freed while forwards run may still be read by one of them (a row's past was
gathered from the trie before an eviction): freed slots wait in quarantine until every forward
that began before the free has ended (`begin` / `end`), and only then are handed out again.
Slots are handed out and freed on one thread (the event loop's); forwards on other threads
only read and write the tensor.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

__all__ = ["KvPool", "SCRATCH_SLOT", "ZERO_SLOT", "kv_layout"]

ZERO_SLOT = 0
SCRATCH_SLOT = 1
_RESERVED = 2


def kv_layout(model: Any) -> tuple[int, int, int] | None:
    """``(layers, kv_heads, head_dim)`` of `model`'s KV, from its config; None if unknown."""
    config = model.config.get_text_config()
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // heads if heads and getattr(config, "hidden_size", None) else None
    )
    if not (layers and kv_heads and head_dim):
        return None
    return int(layers), int(kv_heads), int(head_dim)


class KvPool:
    """A fixed number of KV slots on one device, and which of them are free.

    Args:
        capacity: slots that may hold KV (two more are reserved).
        layout: ``(layers, kv_heads, head_dim)``.
        dtype, device: the model's.
    """

    def __init__(
        self, capacity: int, layout: tuple[int, int, int], dtype: torch.dtype, device: Any
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity}: at least one slot")
        layers, kv_heads, head_dim = layout
        self.capacity = capacity
        self.layout = layout
        # torch.empty: on a CPU, pages are touched (and count as memory) only once written
        self.kv = torch.empty(
            (capacity + _RESERVED, layers, 2, kv_heads, head_dim), dtype=dtype, device=device
        )
        self.kv[ZERO_SLOT].zero_()
        self.kv[SCRATCH_SLOT].zero_()
        #: Free slots as a stack (the top at the end): the lowest slots are used first.
        self._free = np.arange(capacity + _RESERVED - 1, _RESERVED - 1, -1, dtype=np.int64)
        self._free_count = capacity
        #: Freed while forwards ran: (epoch of the free, slots), oldest first.
        self._quarantine: list[tuple[int, np.ndarray]] = []
        self._epoch = 0
        #: The tickets (epochs they began in) of the forwards running.
        self._running: set[int] = set()

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot (all layers, keys and values)."""
        return math.prod(self.kv.shape[1:]) * self.kv.element_size()

    @property
    def free_slots(self) -> int:
        """Slots that `allocate` can hand out now (quarantined ones not counted)."""
        return self._free_count

    @property
    def quarantined_slots(self) -> int:
        """Slots freed while forwards that may read them still run."""
        return sum(len(slots) for _, slots in self._quarantine)

    def allocate(self, count: int) -> np.ndarray | None:
        """`count` free slots, or None if fewer are free."""
        if count > self._free_count:
            return None
        top = self._free_count
        self._free_count = top - count
        return self._free[top - count : top][::-1].copy()

    def free(self, slots: np.ndarray) -> None:
        """Give `slots` back; they are handed out again once no forward may read them."""
        if not len(slots):
            return
        if self._running:
            self._quarantine.append((self._epoch, slots))
        else:
            self._push(slots)

    def begin(self) -> int:
        """A forward's rows are being gathered from the trie: slots freed from now on stay
        quarantined until `end` of the returned ticket."""
        self._epoch += 1
        self._running.add(self._epoch)
        return self._epoch

    def end(self, ticket: int) -> None:
        """The forward of `ticket` is over: release the slots no running forward may read."""
        self._running.discard(ticket)
        oldest = min(self._running, default=self._epoch + 1)
        while self._quarantine and self._quarantine[0][0] < oldest:
            self._push(self._quarantine.pop(0)[1])

    def _push(self, slots: np.ndarray) -> None:
        top = self._free_count
        self._free[top : top + len(slots)] = slots
        self._free_count = top + len(slots)
