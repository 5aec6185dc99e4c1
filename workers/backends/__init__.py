"""Backends behind the `AsyncLM` interface.

`AsyncTransformer` (HuggingFace) and `MockAsyncLM` run anywhere; `AsyncVirtualLM` (vLLM) and
`AsyncSGLTransformer` (SGLang) import their engines only when constructed, so this package
imports without them.
"""

from typing import Any

from lmqueue.shared.lm.interface import AsyncLM
from lmqueue.shared.settings import BACKENDS

from .hf import AsyncTransformer as AsyncTransformer
from .mock import MockAsyncLM as MockAsyncLM

#: The interface and every backend class of `BACKENDS` (the one list of backends).
__all__ = ["AsyncLM", *(target.split(":")[1] for target in BACKENDS.values())]


def __getattr__(name: str) -> Any:
    """The backends not imported above (vLLM's, SGLang's), on first access, by class name."""
    for target in BACKENDS.values():
        module, attribute = target.split(":")
        if attribute == name:
            import importlib

            return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
