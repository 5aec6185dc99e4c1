"""What producers and workers agree on.

Two halves: the wire agreement in this package's modules (`wire` messages, `keys`, `errors`,
`registry`, `settings`, `connections`, `redis_errors`, `shared_cache`), and the model-side
library in `shared.lm` (the `AsyncLM` interface, vocabularies and `Token`, `OutputCache`, the
token-character tries). `shared` imports neither `producer` nor `workers`.
"""

from .errors import (
    BadRequest,
    Busy,
    Cancelled,
    DeadLettered,
    DeadlineExceeded,
    EmptyPrompt,
    Forbidden,
    InvalidName,
    LMQueueError,
    MalformedMessage,
    ModelError,
    OversizeRequest,
    PromptTooLong,
    SettingsError,
    TokenOutOfVocabulary,
    Unavailable,
    UnknownModel,
    UnknownNode,
    VocabularyMismatch,
)
from .keys import WORKER_GROUP, KeySpace
from .registry import ModelInfo, ModelRegistry
from .settings import ClientSettings, RedisSettings, WorkerSettings
from .shared_cache import SharedCache
from .wire import Reply, Request

__all__ = [
    "BadRequest",
    "Busy",
    "Cancelled",
    "ClientSettings",
    "DeadLettered",
    "DeadlineExceeded",
    "EmptyPrompt",
    "Forbidden",
    "InvalidName",
    "KeySpace",
    "LMQueueError",
    "MalformedMessage",
    "ModelError",
    "ModelInfo",
    "ModelRegistry",
    "OversizeRequest",
    "PromptTooLong",
    "RedisSettings",
    "Reply",
    "Request",
    "SettingsError",
    "SharedCache",
    "TokenOutOfVocabulary",
    "Unavailable",
    "UnknownModel",
    "UnknownNode",
    "VocabularyMismatch",
    "WORKER_GROUP",
    "WorkerSettings",
]
