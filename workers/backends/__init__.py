"""Backends behind the `AsyncLM` interface.

`AsyncTransformer` (HuggingFace) and `MockAsyncLM` run anywhere; `AsyncVirtualLM` (vLLM) and
`AsyncSGLTransformer` (SGLang) import their engines only when constructed, so this package
imports without them.
"""

from typing import Any

from lmqueue.shared.lm.interface import AsyncLM

from .hf import AsyncTransformer
from .mock import MockAsyncLM

__all__ = ["AsyncLM", "AsyncTransformer", "MockAsyncLM", "AsyncVirtualLM", "AsyncSGLTransformer"]

#: Backends whose modules load on first access (their engines load only in `from_name`).
_LAZY = {"AsyncVirtualLM": ".vllm", "AsyncSGLTransformer": ".sgl"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
