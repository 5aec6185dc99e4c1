"""Backends behind the `AsyncLM` interface.

`AsyncTransformer` (HuggingFace) and `MockAsyncLM` run anywhere; `AsyncVirtualLM` (vLLM) and
`AsyncSGLTransformer` (SGLang) import their engines only when constructed, so this package
imports without them.
"""

from .base import AsyncLM
from .mock import MockAsyncLM

__all__ = ["AsyncLM", "MockAsyncLM"]
