"""`ModelChangeLock`: forwards of one model run side by side; a change to the model runs alone.

A backend with several forward threads (`AsyncTransformer`'s ``parallel_forwards``) runs
forwards of one model at once: a forward only reads the weights, and each keeps its own
inputs, KV and LoRA rows (`LoraLinear`'s per-thread rows). Loading or unloading a LoRA
adapter replaces layers and their concatenated matrices, which a forward running meanwhile
would see half-changed: it waits until no forward runs, and forwards wait until it is done.
A change waiting keeps new forwards out, so a stream of forwards cannot starve it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["ModelChangeLock"]


class ModelChangeLock:
    """A readers-writer lock whose readers are forwards and whose writers change the model."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._forwards = 0
        self._changing = False

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Run a forward inside: beside other forwards, never beside a change."""
        with self._condition:
            self._condition.wait_for(lambda: not self._changing)
            self._forwards += 1
        try:
            yield
        finally:
            with self._condition:
                self._forwards -= 1
                self._condition.notify_all()

    @contextlib.contextmanager
    def change(self) -> Iterator[None]:
        """Change the model inside: once the running forwards are done, alone."""
        with self._condition:
            self._condition.wait_for(lambda: not self._changing)
            self._changing = True
            self._condition.wait_for(lambda: self._forwards == 0)
        try:
            yield
        finally:
            with self._condition:
                self._changing = False
                self._condition.notify_all()
