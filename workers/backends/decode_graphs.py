"""`DecodeGraphs`: decode forwards on a GPU replayed as CUDA graphs, one per batch shape.

A decode forward (one new token a row, the step of an SMC sampler) launches ~30-40 kernels a
layer one by one from Python, and on a GPU its kernels then take a fraction of its time. With
static shapes the whole forward (gather from the pool, the model, ``log_softmax``, the
scatter back) can be captured once and replayed: shapes are made static by padding a batch
up to a bucket, rows to a power of two (at least 8) and the past to a multiple of
`PAST_STEP`; a padding row has no past, token 0, and keeps no KV (its key sees itself only),
and padded past positions read the pool's zero slot, masked out. The inputs of a replay go
in one copy into the graph's static buffer, and its log-probabilities come back in one copy.

A bucket's graph is captured the first time a batch needs it, on the forward thread, into one
memory pool shared by all the graphs (they never run at once, so the transient tensors of
one can reuse another's memory); a bucket's positions (rows x past) are capped by
``max_positions``, beyond which batches run eagerly. Batches with LoRA rows run eagerly (the
rows' adapter mask is not a static input), as do prefills (several new tokens a row). If a
capture fails (an operation of the model that cannot be captured), graphs are switched off
and every forward runs eagerly, with a warning: the graphs are an optimisation, never a
condition of serving.

On a CPU the same static-buffer path can run without capturing (``emulate=True``): the tests
check there that bucketing and padding change no row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .batch_inputs import BatchInputs, Row, pack
from .kv_pool import KvPool
from .padded_batch import device_forward, to_host

__all__ = ["DecodeGraphs", "PAST_STEP", "bucket_of"]

logger = logging.getLogger(__name__)

#: Pasts are padded up to a multiple of this many positions.
PAST_STEP = 64
#: The fewest rows of a bucket.
MIN_ROWS = 8
_PADDING_ROW = Row(np.zeros(0, dtype=np.int64), (0,))


def bucket_of(rows: int, past: int) -> tuple[int, int]:
    """The ``(rows, past)`` shape a batch of `rows` rows and longest past `past` runs as."""
    bucket_rows = max(MIN_ROWS, 1 << (rows - 1).bit_length())
    return bucket_rows, -(-past // PAST_STEP) * PAST_STEP


@dataclass
class _Graph:
    """One bucket's captured forward: its static input buffer, output, and how to replay."""

    inputs: torch.Tensor
    logprobs: torch.Tensor
    replay: Callable[[], Any]


class DecodeGraphs:
    """Decode forwards of base-model rows, captured and replayed per bucket.

    Args:
        model: the model, on a CUDA device (or anywhere with `emulate`).
        pool: the KV pool the forwards read and write.
        forward_kwargs: the model's extra forward options (``logits_to_keep``).
        max_positions: the most rows x past positions of a bucket (the staging tensor holds
            that many positions of KV); 0 disables the graphs.
        emulate: run the static-buffer path without capturing (tests on a CPU).
    """

    def __init__(
        self,
        model: Any,
        pool: KvPool,
        forward_kwargs: dict[str, Any],
        max_positions: int,
        emulate: bool = False,
    ) -> None:
        self.model = model
        self.pool = pool
        self.forward_kwargs = forward_kwargs
        self.max_positions = max_positions
        self.emulate = emulate
        self.enabled = max_positions > 0 and (emulate or pool.kv.device.type == "cuda")
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._memory: Any = None
        #: Replays and captures so far (for tests and benchmarks).
        self.replays = 0
        self.captures = 0

    def fits(self, rows: Sequence[Row]) -> bool:
        """Whether `rows` can run as a replay: decode rows of the base model in a bucket."""
        if not self.enabled or any(len(r.new_tokens) != 1 or r.adapter for r in rows):
            return False
        bucket_rows, past = bucket_of(len(rows), max(r.past_len for r in rows))
        return bucket_rows * (past + 1) <= self.max_positions

    def forget(self) -> None:
        """Drop every captured graph (their memory goes back to the caching allocator)."""
        self._graphs.clear()
        self._memory = None

    def run(self, rows: Sequence[Row]) -> torch.Tensor | None:
        """The rows' float32 log-probabilities on the host, or None if they must run eagerly
        (`fits` said no, or capturing failed and graphs are now off)."""
        if not self.fits(rows):
            return None
        key = bucket_of(len(rows), max(r.past_len for r in rows))
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(*key)
            if graph is None:
                return None
        padded = list(rows) + [_PADDING_ROW] * (key[0] - len(rows))
        host, _ = pack(padded, key[1], 1)
        graph.inputs.copy_(torch.from_numpy(host), non_blocking=True)
        graph.replay()
        self.replays += 1
        logprobs = graph.logprobs[: len(rows)]
        # the static output is overwritten by the next replay: the rows get a copy of their own
        return logprobs.clone() if logprobs.device.type == "cpu" else to_host(logprobs)

    def _capture(self, bucket_rows: int, past: int) -> _Graph | None:
        """Capture the forward of a `bucket_rows` x `past` batch; None (graphs off) on failure."""
        device = self.pool.kv.device
        host, _ = pack([_PADDING_ROW] * bucket_rows, past, 1)  # harmless: writes scratch only
        inputs = torch.from_numpy(host).to(device)

        def forward() -> torch.Tensor:
            batch = BatchInputs.view(inputs, bucket_rows, past, 1, keeps_kv=True)
            return device_forward(self.model, self.pool, batch, bucket_rows, self.forward_kwargs)

        if self.emulate:
            holder: dict[str, torch.Tensor] = {"out": forward()}

            def replay() -> None:
                holder["out"].copy_(forward())

            graph = _Graph(inputs, holder["out"], replay)
        else:
            try:
                graph = self._cuda_capture(inputs, forward)
            except Exception as exc:  # any operation that cannot be captured: run eagerly
                logger.warning(
                    "CUDA graphs are off, forwards run eagerly: capturing a %d x %d decode "
                    "forward failed: %s: %s", bucket_rows, past, type(exc).__name__, exc,
                )  # fmt: skip
                self.enabled = False
                self.forget()
                torch.cuda.synchronize(device)
                return None
        self._graphs[(bucket_rows, past)] = graph
        self.captures += 1
        logger.info("captured the decode forward of %d rows x %d past", bucket_rows, past)
        return graph

    def _cuda_capture(self, inputs: torch.Tensor, forward: Callable[[], torch.Tensor]) -> _Graph:
        """Warm `forward` up on a side stream, then capture it into the shared memory pool."""
        device = inputs.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            forward()  # lets libraries set up their handles and workspaces before capture
        torch.cuda.current_stream(device).wait_stream(side)
        if self._memory is None:
            self._memory = torch.cuda.graph_pool_handle()
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph, pool=self._memory, capture_error_mode="thread_local"):
            logprobs = forward()
        return _Graph(inputs, logprobs, cuda_graph.replay)
