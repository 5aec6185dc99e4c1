"""What producers and workers agree on: messages, keys, settings, errors, vocabularies, caches."""

from .errors import (
    BadRequest,
    Busy,
    Cancelled,
    DeadLettered,
    DeadlineExceeded,
    EmptyPrompt,
    LMQueueError,
    MalformedMessage,
    ModelError,
    OversizeRequest,
    PromptTooLong,
    TokenOutOfVocabulary,
    Unavailable,
    UnknownModel,
    UnknownNode,
    VocabularyMismatch,
)
from .keys import WORKER_GROUP, KeySpace
from .output_cache import OutputCache
from .registry import ModelInfo, ModelRegistry
from .settings import ClientSettings, RedisSettings, SettingsError, WorkerSettings
from .shared_cache import SharedCache
from .tokens import Token
from .trie import AsyncTokenCharacterTrie, ParallelTokenCharacterTrie, TokenCharacterTrie
from .validation import check_prompt
from .vocab import decode_vocab
from .wire import Reply, Request

__all__ = [
    "AsyncTokenCharacterTrie",
    "BadRequest",
    "Busy",
    "Cancelled",
    "ClientSettings",
    "DeadLettered",
    "DeadlineExceeded",
    "EmptyPrompt",
    "KeySpace",
    "LMQueueError",
    "MalformedMessage",
    "ModelError",
    "ModelInfo",
    "ModelRegistry",
    "OutputCache",
    "OversizeRequest",
    "ParallelTokenCharacterTrie",
    "PromptTooLong",
    "RedisSettings",
    "Reply",
    "Request",
    "SettingsError",
    "SharedCache",
    "Token",
    "TokenCharacterTrie",
    "TokenOutOfVocabulary",
    "Unavailable",
    "UnknownModel",
    "UnknownNode",
    "VocabularyMismatch",
    "WORKER_GROUP",
    "WorkerSettings",
    "check_prompt",
    "decode_vocab",
]
