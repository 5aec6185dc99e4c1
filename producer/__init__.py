"""The client side: `QueueLM`, a drop-in `AsyncLM` whose computation happens on workers."""

from .client import QueueLM
from .experiments import Experiments, ExperimentStatus
from .queue_trie import QueueTrie

__all__ = ["QueueLM", "QueueTrie", "Experiments", "ExperimentStatus"]
