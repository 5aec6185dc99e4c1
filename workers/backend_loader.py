"""Building the backend a worker's settings name."""

from __future__ import annotations

from typing import Any

from shared.settings import WorkerSettings

from .backends.base import AsyncLM

__all__ = ["load_backend"]


def load_backend(settings: WorkerSettings) -> AsyncLM:
    """Load `settings.backend` for `settings.model` with `settings.backend_opts`.

    Blocking (model loading takes seconds); call it before serving or in a thread.
    """
    opts: dict[str, Any] = dict(settings.backend_opts)
    if settings.backend == "mock":
        from .backends.mock import MockAsyncLM

        return MockAsyncLM.from_name(settings.model, **opts)
    if settings.backend == "hf":
        from .backends.hf import AsyncTransformer

        if settings.device:
            opts.setdefault("hf_opts", {}).setdefault("device_map", settings.device)
        # One stream batch becomes one forward: the worker submits a batch's prompts at once.
        opts.setdefault("batch_size", settings.batch_size)
        opts.setdefault("max_batch_tokens", settings.max_batch_tokens)
        opts.setdefault("timeout", settings.max_wait_ms / 1000)
        return AsyncTransformer.from_name(settings.model, **opts)
    if settings.backend == "vllm":
        from .backends.vllm import AsyncVirtualLM

        return AsyncVirtualLM.from_name(settings.model, **opts)
    from .backends.sgl import AsyncSGLTransformer

    return AsyncSGLTransformer.from_name(settings.model, **opts)
