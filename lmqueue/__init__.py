"""lmqueue: next-token log-probabilities of language models, served through Redis streams.

Programs ``await lm.next_token_logprobs(token_ids)`` on a `QueueLM` as they would on an
in-process model, while a pool of workers batches the calls of many programs. This package is
the whole distribution: its subpackages are ``lmqueue.producer`` (the client),
``lmqueue.workers`` (``python -m lmqueue.workers``), ``lmqueue.shared`` (what both sides agree
on) and ``lmqueue.scheduler`` (the experiment scheduler); the modules beside them are the
application (``lmq``, the demo, the benchmarks). Every error of the tree is importable from
here (``except lmqueue.Busy``).
"""

from lmqueue.producer import Experiments, ExperimentStatus, QueueLM, QueueTrie
from lmqueue.shared.errors import (
    AdaptersUnsupported,
    AuthenticationFailed,
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
    QuotaExceeded,
    SettingsError,
    TokenOutOfVocabulary,
    Unavailable,
    UnknownAdapter,
    UnknownExperiment,
    UnknownModel,
    UnknownNode,
    VocabularyMismatch,
)

__all__ = [
    "QueueLM",
    "QueueTrie",
    "Experiments",
    "ExperimentStatus",
    # every error a request's future can raise (the tree: lmqueue.shared.errors)
    "AdaptersUnsupported",
    "AuthenticationFailed",
    "BadRequest",
    "Busy",
    "Cancelled",
    "DeadLettered",
    "DeadlineExceeded",
    "EmptyPrompt",
    "Forbidden",
    "InvalidName",
    "LMQueueError",
    "MalformedMessage",
    "ModelError",
    "OversizeRequest",
    "PromptTooLong",
    "QuotaExceeded",
    "SettingsError",
    "TokenOutOfVocabulary",
    "Unavailable",
    "UnknownAdapter",
    "UnknownExperiment",
    "UnknownModel",
    "UnknownNode",
    "VocabularyMismatch",
]
