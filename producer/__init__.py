"""The client side: `QueueLM`, a drop-in `AsyncLM` whose computation happens on workers."""

from .client import QueueLM

__all__ = ["QueueLM"]
