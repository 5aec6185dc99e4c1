"""Building SGLang 0.5.23's ``Engine`` with the capture processor, and computing rows on it.

UNVERIFIED on a real engine: SGLang needs CUDA (its kernels have no CPU build on PyPI), so
this module is tested only against SGLang's real classes unpacked offline
(``tests/test_sgl_adapter.py`` in ``make test-engines``), never on a running engine.

Public SGLang surface used: ``sglang.Engine(**server_args)`` with
``enable_custom_logit_processor``, ``Engine.async_generate(input_ids=..., sampling_params=...,
custom_logit_processor=...)`` (``max_new_tokens=1``, ``custom_params``), ``Engine.loop``,
``Engine.flush_cache``, ``Engine.get_server_info`` (its ``max_req_input_len``),
``Engine.shutdown`` and ``CustomLogitProcessor.to_str``. No private name: the scheduler runs in
SGLang's own processes, and rows come back through `sgl_capture.RowSlots`.

One thread calls the engine (`AsyncSGLTransformer`'s executor): `SGLEngine.compute` runs a
set of prompts as concurrent ``async_generate`` calls on the engine's own event loop
(SGLang batches them), one slot of shared memory each.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lmqueue.shared.errors import BadRequest, ModelError

from .engine_backend import Key, Result, engine_error
from .engine_imports import SGLANG, import_engine
from .sgl_capture import COUNT_KEY, SEQ_KEY, SHM_KEY, SLOT_KEY, RowSlots, capture_processor_class

__all__ = ["SGLEngine", "build_sgl_engine", "SGL_DEFAULTS"]

#: ``sglang.Engine`` (ServerArgs) defaults; `engine_opts` override them.
SGL_DEFAULTS: dict[str, Any] = {
    "enable_custom_logit_processor": True,  # the capture processor
    "skip_tokenizer_init": True,  # token ids in, nothing to detokenize
    "allow_auto_truncate": False,  # a long prompt must fail, not lose its head
    "log_level": "error",
}


def _nothing() -> None:
    """No engine to release."""


@dataclass
class SGLEngine:
    """An SGLang engine (or a fake with its methods) and the shared rows of its processor."""

    engine: Any  # sglang.Engine: async_generate, loop, flush_cache, shutdown
    slots: RowSlots
    processor: str  # the capture processor, serialized as SGLang ships it
    vector_size: int
    max_prompt_tokens: int
    revision: str = "unknown"
    shutdown: Callable[[], None] = _nothing
    _seqs: Any = field(default_factory=itertools.count)

    def compute(self, keys: list[Key]) -> dict[Key, Result]:
        """Rows of distinct prompts, `slots.count` at a time; call from one thread only."""
        results: dict[Key, Result] = {}
        for start in range(0, len(keys), self.slots.count):
            chunk = keys[start : start + self.slots.count]
            results.update(self.engine.loop.run_until_complete(self._chunk(chunk)))
        return results

    def flush(self) -> bool:
        """Drop SGLang's KV and radix caches; False if it refused (requests running)."""
        outcome = self.engine.flush_cache()
        return bool(getattr(outcome, "success", outcome))

    async def _chunk(self, keys: list[Key]) -> dict[Key, Result]:
        seqs = [next(self._seqs) for _ in keys]
        outputs = await asyncio.gather(
            *(
                self._one(key, slot, seq)
                for slot, (key, seq) in enumerate(zip(keys, seqs, strict=True))
            ),
            return_exceptions=True,
        )
        rows: dict[Key, torch.Tensor] = {}
        results: dict[Key, Result] = {}
        for slot, (key, seq, output) in enumerate(zip(keys, seqs, outputs, strict=True)):
            if isinstance(output, BaseException):
                results[key] = _refusal(output)
                continue
            reason = (output.get("meta_info") or {}).get("finish_reason") or {}
            row = self.slots.read(slot, seq)
            if reason.get("type") == "abort" or row is None:
                results[key] = ModelError(f"SGLang returned no logits row (finish {reason!r})")
            else:
                rows[key] = torch.from_numpy(row)
        if rows:  # one log_softmax for every row of the chunk
            block = torch.log_softmax(torch.stack(list(rows.values())), dim=-1)
            results.update({key: block[i] for i, key in enumerate(rows)})
        return results

    async def _one(self, key: Key, slot: int, seq: int) -> Any:
        params = {
            "max_new_tokens": 1,
            "temperature": 0.0,
            "custom_params": {
                SHM_KEY: self.slots.name,
                COUNT_KEY: self.slots.count,
                SLOT_KEY: slot,
                SEQ_KEY: seq,
            },
        }
        return await self.engine.async_generate(
            input_ids=list(key), sampling_params=params, custom_logit_processor=self.processor
        )


def _refusal(exc: BaseException) -> BaseException:
    """SGLang's input checks raise ValueError: a bad request; anything else: the engine's."""
    if isinstance(exc, ValueError):
        return BadRequest(f"SGLang refused the prompt: {exc}")
    return engine_error("SGLang", exc)


def build_sgl_engine(
    model: str, engine_opts: dict[str, Any] | None, gpu_id: int, capture_slots: int = 64
) -> SGLEngine:
    """Start ``sglang.Engine`` on `model` (a directory or hub id) with the capture processor.

    Raises:
        MissingEngine: SGLang is absent or not a supported version.
    """
    sglang = import_engine(SGLANG, "sglang")
    base = import_engine(SGLANG, "sglang.srt.sampling.custom_logit_processor")
    from transformers import AutoConfig

    vocab = int(AutoConfig.from_pretrained(model).vocab_size)
    opts = {**SGL_DEFAULTS, "base_gpu_id": gpu_id, **(engine_opts or {})}
    engine = sglang.Engine(model_path=model, **opts)
    slots = RowSlots(capture_slots, vocab)
    info = engine.get_server_info()

    def shutdown() -> None:
        try:
            engine.shutdown()
        finally:
            slots.close()

    processor: Any = capture_processor_class(base.CustomLogitProcessor)
    return SGLEngine(
        engine=engine,
        slots=slots,
        processor=processor.to_str(),
        vector_size=vocab,
        max_prompt_tokens=int(info["max_req_input_len"]) - 1,  # SGLang refuses >= this
        revision=f"sglang-{info.get('dtype', 'auto')}",
        shutdown=shutdown,
    )
