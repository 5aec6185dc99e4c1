"""The error hierarchy shared by clients and workers.

An error raised for one request travels to that request's future as the same type: the worker
encodes it with `to_wire`, the client rebuilds it with `from_wire`. Subclasses of builtin errors
keep programs written against in-process backends working (`except ValueError`, `except
TimeoutError`).

    LMQueueError
    ├── SettingsError (ValueError)           a setting has a value that cannot be used
    │   └── AdaptersUnsupported              the backend cannot serve LoRA adapters
    ├── BadRequest (ValueError)              the request itself is wrong; retrying will not help
    │   ├── InvalidName                      a model, tenant, worker or client name unfit for a key
    │   ├── EmptyPrompt
    │   ├── TokenOutOfVocabulary
    │   ├── PromptTooLong
    │   ├── OversizeRequest
    │   ├── UnknownNode
    │   ├── VocabularyMismatch
    │   ├── UnknownExperiment                no experiment of this tenant has that id
    │   └── UnknownAdapter (LookupError)     no adapter of that name is served to this tenant
    ├── MalformedMessage (ValueError)        bytes on the wire that do not decode to a message
    ├── UnknownModel (LookupError)           no worker ever published the model
    ├── ModelError (RuntimeError)            the backend failed while computing
    ├── DeadlineExceeded (TimeoutError)      the request's deadline passed before its result
    ├── Busy                                 admission control refused a new request
    │   └── QuotaExceeded                    the tenant is at one of its quotas
    ├── Forbidden                            Redis refused an operation to this user (ACL),
    │   │                                    or the adapter named is another tenant's
    │   └── AuthenticationFailed             wrong user or password (never retried)
    ├── DeadLettered                         the request failed on every delivery and was parked
    ├── Cancelled                            the request was withdrawn (client closed, reset)
    └── Unavailable (ConnectionError)        Redis or the workers cannot be reached
"""

from __future__ import annotations

from typing import Any

#: Error class name -> class, as the wire names them; filled by `LMQueueError.__init_subclass__`.
_BY_NAME: dict[str, type[LMQueueError]] = {}

__all__ = [
    "LMQueueError",
    "SettingsError",
    "BadRequest",
    "InvalidName",
    "EmptyPrompt",
    "TokenOutOfVocabulary",
    "PromptTooLong",
    "OversizeRequest",
    "UnknownNode",
    "VocabularyMismatch",
    "UnknownExperiment",
    "UnknownAdapter",
    "AdaptersUnsupported",
    "MalformedMessage",
    "UnknownModel",
    "ModelError",
    "DeadlineExceeded",
    "Busy",
    "Forbidden",
    "AuthenticationFailed",
    "QuotaExceeded",
    "DeadLettered",
    "Cancelled",
    "Unavailable",
    "to_wire",
    "from_wire",
]


class LMQueueError(Exception):
    """Raised for any failure of an lmqueue request; the root of the hierarchy.

    Every subclass registers itself under its class name (`__init_subclass__`): that name is
    what `to_wire` writes and `from_wire` reads, so a new error is one class, nothing else.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        known = _BY_NAME.get(cls.__name__)
        if known is not None and known is not cls:
            raise TypeError(f"an lmqueue error named {cls.__name__} exists: {known!r}")
        _BY_NAME[cls.__name__] = cls

    def __init__(self, message: str, /, **data: Any) -> None:
        super().__init__(message)
        self.message = message
        self.data = data

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self).__name__, self.message, self.data))


_BY_NAME["LMQueueError"] = LMQueueError


class SettingsError(LMQueueError, ValueError):
    """Raised when a setting has a value that cannot be used; names the key and the value."""


class BadRequest(LMQueueError, ValueError):
    """Raised when a request is invalid in itself; sending it again cannot succeed."""


class InvalidName(BadRequest):
    """Raised when a model, tenant, worker or client name cannot be part of a Redis key."""


class EmptyPrompt(BadRequest):
    """Raised when a request carries no tokens."""


class TokenOutOfVocabulary(BadRequest):
    """Raised when a token id is negative or not below the model's vocabulary size."""


class PromptTooLong(BadRequest):
    """Raised when a prompt is longer than the model's context window."""


class OversizeRequest(BadRequest):
    """Raised when an encoded request exceeds the configured size limit."""


class UnknownNode(BadRequest):
    """Raised when a trie mass request names node ids that the vocabulary's trie lacks."""


class VocabularyMismatch(BadRequest):
    """Raised when a vector's length does not match the vocabulary it is used with."""


class UnknownExperiment(BadRequest, LookupError):
    """Raised when the tenant has no experiment of the given id."""


class UnknownAdapter(BadRequest, LookupError):
    """Raised when a request names a LoRA adapter the model does not serve to this tenant."""


class AdaptersUnsupported(SettingsError):
    """Raised when a backend cannot serve a LoRA adapter (at start, or on `lmq adapter add`)."""


class MalformedMessage(LMQueueError, ValueError):
    """Raised when bytes read from a stream do not decode to a valid message."""


class UnknownModel(LMQueueError, LookupError):
    """Raised when no worker has published the requested model."""


class ModelError(LMQueueError, RuntimeError):
    """Raised when the backend failed while computing a request's result."""


class DeadlineExceeded(LMQueueError, TimeoutError):
    """Raised when a request's deadline passes before its result arrives."""


class Busy(LMQueueError):
    """Raised when the model's backlog is over its bound and a new request is refused."""


class QuotaExceeded(Busy):
    """Raised when a tenant is at a quota (``data["quota"]`` names it) and a request is refused.

    ``max_inflight``: requests queued or running for the model; ``max_tokens_per_s``: prompt
    tokens admitted per second. Requests accepted earlier are not affected.
    """


class Forbidden(LMQueueError):
    """Raised when Redis refuses an operation to this client's user (an ACL rule: NOPERM), or
    a request names a LoRA adapter private to another tenant."""


class AuthenticationFailed(Forbidden):
    """Raised when Redis rejects the URL's user or password (WRONGPASS, NOAUTH); not retried.

    ``data["url"]`` is the URL with its password masked.
    """


class DeadLettered(LMQueueError):
    """Raised when a request failed on every delivery and was moved to the dead-letter stream."""


class Cancelled(LMQueueError):
    """Raised when a request is withdrawn before its result (client closed, queries reset)."""


class Unavailable(LMQueueError, ConnectionError):
    """Raised when Redis or the model's workers cannot be reached."""


def _rebuild(name: str, message: str, data: dict[str, Any]) -> LMQueueError:
    cls = _BY_NAME.get(name, LMQueueError)
    return cls(message, **data)


def to_wire(error: BaseException) -> dict[str, Any]:
    """Describe an error as a msgpack-able map; foreign exceptions become `ModelError`."""
    if isinstance(error, LMQueueError):
        return {"type": type(error).__name__, "message": error.message, "data": _plain(error.data)}
    return {"type": "ModelError", "message": f"{type(error).__name__}: {error}", "data": {}}


def from_wire(payload: Any) -> LMQueueError:
    """Rebuild the error described by `to_wire`; anything unrecognisable is a `MalformedMessage`."""
    if not isinstance(payload, dict):
        return MalformedMessage(f"error payload is {type(payload).__name__}, not a map")
    name = payload.get("type")
    message = payload.get("message")
    data = payload.get("data") or {}
    if not isinstance(name, str) or not isinstance(message, str) or not isinstance(data, dict):
        return MalformedMessage("error payload lacks a string type and message")
    if not all(isinstance(key, str) for key in data):
        return MalformedMessage("error data keys must be strings")
    return _rebuild(name, message, data)


def _plain(data: dict[str, Any]) -> dict[str, Any]:
    """Keep only values msgpack can carry; others become their repr."""
    plain: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, (str, int, float, bool, bytes, type(None))):
            plain[key] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, (str, int)) for v in value):
            plain[key] = list(value)
        else:
            plain[key] = repr(value)
    return plain
