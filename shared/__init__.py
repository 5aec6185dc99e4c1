"""What producers and workers agree on.

Two halves: the wire agreement in this package's modules (`wire` messages, `keys`, `prompt_key`,
`errors`, `registry`, `settings`, `connections`, `redis_errors`, `shared_cache`), and the model-side
library in `shared.lm` (the `AsyncLM` interface, vocabularies and `Token`, `OutputCache`, the
token-character tries). `shared` imports neither `producer` nor `workers`. The errors of
`errors` are exported from the top package, ``lmqueue``.
"""

from .keys import WORKER_GROUP, KeySpace
from .prompt_key import PromptKey
from .registry import ModelInfo, ModelRegistry
from .settings import ClientSettings, RedisSettings, WorkerSettings
from .shared_cache import SharedCache
from .wire import Reply, Request

__all__ = [
    "ClientSettings",
    "KeySpace",
    "ModelInfo",
    "ModelRegistry",
    "PromptKey",
    "RedisSettings",
    "Reply",
    "Request",
    "SharedCache",
    "WORKER_GROUP",
    "WorkerSettings",
]
