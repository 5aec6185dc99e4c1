"""The client side: `QueueLM`, a drop-in `AsyncLM` whose computation happens on workers."""

__all__: list[str] = []
