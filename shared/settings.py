"""Settings of each process, built once in ``main()`` from the environment.

Each process kind has one frozen dataclass. `from_env` reads ``LMQ_<FIELD>`` variables (plus
the conventional ``REDIS_URL``), converts them by the field's type and reports a bad value with
its key; tests pass a plain dict. Nothing here reads the environment at import time, and
nothing outside this module reads it at all: the CLI, the demo, the worker and model loading
take their settings from here.

The worker's batching defaults are defined once (`DEFAULT_BATCH_SIZE`, ...) and are also the
defaults of the backends that batch, so an in-process backend batches like a worker's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

from .adapters import ADAPTER_NAME
from .errors import InvalidName, SettingsError
from .keys import KeySpace, validate_name
from .partitions import DEFAULT_BLOCK_TOKENS

__all__ = [
    "SettingsError",
    "RedisSettings",
    "WorkerSettings",
    "ClientSettings",
    "BACKENDS",
    "EVENT_LOOPS",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_GPU_BATCH_SIZE",
    "DEFAULT_GPU_MAX_BATCH_TOKENS",
    "DEFAULT_MAX_BATCH_TOKENS",
    "DEFAULT_ANTICIPATE_MS",
    "DEFAULT_MAX_WAIT_MS",
    "configured_redis_url",
    "configured_control_url",
    "redis_url_source",
    "configured_metrics_host",
    "model_cache_dir",
    "url_user",
    "mask_url",
    "mask_secrets",
    "url_without_credentials",
    "with_credentials_of",
    "same_instance",
]

T = TypeVar("T")
ENV_PREFIX = "LMQ_"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
#: The backends ``lmq worker --backend`` knows: name -> "module:class", the one list of them.
#: A new backend is a module under ``workers/backends`` and a line here; the worker's loader,
#: its ``--backend`` choices and ``lmqueue.workers.backends``' lazy names read this (strings
#: only: ``shared`` imports no worker code, and an engine is imported only when it is used).
BACKENDS: Mapping[str, str] = types.MappingProxyType(
    {
        "hf": "lmqueue.workers.backends.hf:AsyncTransformer",
        "mock": "lmqueue.workers.backends.mock:MockAsyncLM",
        "vllm": "lmqueue.workers.backends.vllm:AsyncVirtualLM",
        "sgl": "lmqueue.workers.backends.sgl:AsyncSGLTransformer",
    }
)
#: The event loops a worker runs on (``LMQ_EVENT_LOOP``; `workers.event_loop`).
EVENT_LOOPS = ("auto", "uvloop", "asyncio")
#: Entries a worker reads per batch; also the most prompts a batching backend runs at once.
DEFAULT_BATCH_SIZE = 32
#: Token budget of one forward pass.
DEFAULT_MAX_BATCH_TOKENS = 8192
#: The same two when an hf worker runs on a GPU: a whole SMC step of hundreds of particles is
#: one forward there (its decode rows cost little more than a few), and so is its prompt.
DEFAULT_GPU_BATCH_SIZE = 256
DEFAULT_GPU_MAX_BATCH_TOKENS = 65_536
#: How long a worker (and a batching backend) waits to fill a batch.
DEFAULT_MAX_WAIT_MS = 5
#: Long enough for a local light tenant's round trip (its replies written to its next calls
#: read) with room for its tail; a longer wait costs only when a tenant comes back late or not
#: at all, and `workers.anticipation` bounds it by the forward's time (BENCHMARKS.md, fairness).
DEFAULT_ANTICIPATE_MS = 20


def configured_redis_url(environ: Mapping[str, str] | None = None) -> str | None:
    """The queue URL set in the environment (``LMQ_REDIS_URL`` or ``REDIS_URL``), else None."""
    environ = os.environ if environ is None else environ
    return environ.get("LMQ_REDIS_URL") or environ.get("REDIS_URL") or None


def redis_url_source(flag: str | None, environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The queue URL a command uses and where it came from: the flag, ``LMQ_REDIS_URL``,
    ``REDIS_URL``, or the default (which a command says it fell back to)."""
    environ = os.environ if environ is None else environ
    if flag:
        return flag, "--redis-url"
    for key in ("LMQ_REDIS_URL", "REDIS_URL"):
        if environ.get(key):
            return environ[key], key
    return DEFAULT_REDIS_URL, "default"


def configured_metrics_host(flag: str | None, environ: Mapping[str, str] | None = None) -> str:
    """The address probes and metrics listen on: the flag, ``LMQ_METRICS_HOST``, else
    loopback (metrics name tenants and models; containers set 0.0.0.0)."""
    environ = os.environ if environ is None else environ
    return flag or environ.get("LMQ_METRICS_HOST") or "127.0.0.1"


def configured_control_url(environ: Mapping[str, str] | None = None) -> str | None:
    """The scheduler's control-plane URL set in the environment (``LMQ_CONTROL_URL``), else None."""
    environ = os.environ if environ is None else environ
    return environ.get("LMQ_CONTROL_URL") or None


def url_user(url: str) -> str | None:
    """The ACL user name in a Redis URL (``redis://alice:pw@host/0`` -> alice), else None."""
    username = urlsplit(url).username
    return unquote(username) if username else None


#: The password part of a URL's userinfo: ``scheme://user:PASSWORD@`` (user may be empty).
_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^:@/\s]*):((?:(?!://)[^\s])*)@", re.IGNORECASE)


def mask_secrets(text: str) -> str:
    """`text` with the password of every URL in it replaced by ``***``.

    The last line of defence for anything printed or logged: usage errors, exception
    messages, log lines. ``redis://alice:s3cret@host/0`` -> ``redis://alice:***@host/0``.
    """
    return _PASSWORD.sub(r"\1:***@", text)


def mask_url(url: str) -> str:
    """`url` with its password masked, for messages and status output."""
    return mask_secrets(url)


def url_without_credentials(url: str) -> str:
    """`url` with no user or password: what may be published for anyone to read."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def same_instance(url: str, other: str) -> bool:
    """Whether two URLs name the same server (scheme, host and port; users may differ)."""
    a, b = urlsplit(url), urlsplit(other)
    return (a.scheme, a.hostname, a.port or 6379, a.path if a.scheme == "unix" else "") == (
        b.scheme, b.hostname, b.port or 6379, b.path if b.scheme == "unix" else ""
    )  # fmt: skip


def with_credentials_of(url: str, source_url: str) -> str:
    """`url` carrying `source_url`'s user and password (a tenant's identity on another
    instance of the same deployment: `lmq tenant add` makes the same user on each)."""
    source, parts = urlsplit(source_url), urlsplit(url)
    userinfo = source.netloc.rpartition("@")[0]
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{userinfo}@{host}" if userinfo else host
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def model_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where converted models and tokenizers are kept: ``LMQ_CACHE_DIR`` or ~/.cache/lmqueue."""
    environ = os.environ if environ is None else environ
    return Path(environ.get("LMQ_CACHE_DIR") or Path.home() / ".cache" / "lmqueue")


@dataclass(frozen=True)
class RedisSettings:
    """Where the queue and the shared cache live, and how keys are named.

    The queue role (request and reply streams, registry) must run with ``noeviction``; the
    cache role may be a separate instance with an LRU policy (see ops/redis/). With no
    `cache_url` both roles share one instance, and cache entries are bounded by their TTL.
    """

    url: str = DEFAULT_REDIS_URL
    cache_url: str | None = None
    prefix: str = "lmq"
    tenant: str = "default"
    connect_timeout_s: float = 5.0
    #: A blocking read still unanswered this long after its block time ended is abandoned and
    #: retried on a new connection: the peer is alive but silent (frozen, blackholed).
    stall_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.stall_timeout_s <= 0:
            raise SettingsError(f"stall_timeout_s={self.stall_timeout_s!r}: must be > 0")
        for name in ("url", "cache_url"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("redis://", "rediss://", "unix://")):
                raise SettingsError(
                    f"{name}={mask_url(value)!r}: expected a redis://, rediss:// or unix:// URL"
                )
        try:
            self.keyspace()
        except InvalidName as exc:
            raise SettingsError(exc.message) from None

    @classmethod
    def from_url(cls, url: str, **overrides: Any) -> RedisSettings:
        """Settings for the Redis at `url`, other fields at their defaults or `overrides`."""
        return cls(url=url, **overrides)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RedisSettings:
        """Read ``LMQ_REDIS_URL`` (or ``REDIS_URL``), ``LMQ_CACHE_URL``, ``LMQ_PREFIX``, ..."""
        environ = os.environ if environ is None else environ
        values = _from_environ(cls, environ, skip={"url"})
        url = configured_redis_url(environ)
        if url:
            values["url"] = url
        return cls(**values)

    @property
    def effective_cache_url(self) -> str:
        """The URL of the cache role: `cache_url`, or the queue's own."""
        return self.cache_url or self.url

    @property
    def separate_cache(self) -> bool:
        """Whether the cache role is another instance than the queue's."""
        return self.cache_url is not None and not same_instance(self.cache_url, self.url)

    @property
    def published_cache_address(self) -> str:
        """What workers publish in the registry for clients to find the cache: its URL
        without credentials (each client brings its own user), empty with no separate one."""
        return url_without_credentials(self.cache_url or "") if self.separate_cache else ""

    def keyspace(self) -> KeySpace:
        """The key layout for this prefix and tenant."""
        return KeySpace(self.prefix, self.tenant)


def _default_worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class WorkerSettings:
    """Everything a worker process needs; see README's configuration reference."""

    model: str
    backend: str = "hf"
    redis: RedisSettings = field(default_factory=RedisSettings)
    #: Stable consumer name; a restarted worker with the same name finishes its own pending work.
    name: str = field(default_factory=_default_worker_name)
    batch_size: int = DEFAULT_BATCH_SIZE
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    #: `batch_size` and `max_batch_tokens` of an hf worker whose model is on a GPU.
    gpu_batch_size: int = DEFAULT_GPU_BATCH_SIZE
    gpu_max_batch_tokens: int = DEFAULT_GPU_MAX_BATCH_TOKENS
    max_wait_ms: int = DEFAULT_MAX_WAIT_MS
    #: How long a busy worker holds its next batch for a tenant whose calls the last one
    #: answered (a closed loop's next calls; workers/anticipation.py). 0: never.
    anticipate_ms: int = DEFAULT_ANTICIPATE_MS
    max_prompt_tokens: int = 0  # 0: the model's context window
    device: str = ""
    backend_opts: dict[str, Any] = field(default_factory=dict)
    cache_writes: bool = True
    cache_ttl_s: int = 3600
    reply_ttl_s: int = 600
    claim_idle_ms: int = 30_000
    max_deliveries: int = 3
    #: Consumers idle this long with nothing pending are removed from the group (0: never).
    dead_consumer_idle_ms: int = 3_600_000
    #: The dead-letter stream keeps about this many newest entries (an archive, not a queue).
    max_dead_letters: int = 10_000
    heartbeat_s: float = 2.0
    shutdown_grace_s: float = 30.0
    max_request_bytes: int = 1 << 20
    #: Published to clients: new requests fail with Busy past this many queued entries (0: none).
    max_backlog: int = 50_000
    #: Request stream partitions (prefix affinity, shared/partitions.py); the same on every
    #: worker of a model. 1: one stream that any worker takes from.
    partitions: int = 1
    #: Leading prompt tokens whose hash chooses a partition (published to clients).
    partition_block_tokens: int = DEFAULT_BLOCK_TOKENS
    #: How long an entry waits in another owner's partition before an idle worker takes it.
    steal_after_ms: int = 500
    #: glibc serves blocks from this size by mmap, so freed ones leave the process (0: glibc's
    #: own moving threshold: faster on CPU, but RSS creeps past the memory bounds).
    malloc_mmap_threshold: int = 128 << 10
    log_level: str = "INFO"
    #: Port of /metrics, /healthz and /readyz (0: no server).
    metrics_port: int = 0
    #: LoRA adapters to load and publish, name -> PEFT directory (``--adapter NAME=PATH``;
    #: LMQ_ADAPTERS as a JSON object). Published public; `lmq adapter add` adds more.
    adapters: dict[str, str] = field(default_factory=dict)
    #: Address they listen on: loopback unless set (containers: 0.0.0.0, for the kubelet).
    metrics_host: str = "127.0.0.1"
    #: A diagnostic: record stage marks (forwards, picks, writes) in this directory
    #: (`shared.stage_trace`; "": none).
    stage_trace_dir: str = ""
    #: The worker's event loop (`workers.event_loop`): "auto" runs uvloop's where it is
    #: installed (the loop's CPU a reply 5-7% lower), "uvloop" requires it, "asyncio" is
    #: the standard library's.
    event_loop: str = "auto"

    def __post_init__(self) -> None:
        if not self.model:
            raise SettingsError("model is required (LMQ_MODEL or --model)")
        for adapter in self.adapters:
            if not isinstance(adapter, str) or not ADAPTER_NAME.match(adapter):
                raise SettingsError(f"adapter name {adapter!r}: use 1-64 of A-Z a-z 0-9 . _ -")
        if self.backend not in BACKENDS:
            raise SettingsError(f"backend={self.backend!r}: expected one of {', '.join(BACKENDS)}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise SettingsError(f"log_level={self.log_level!r}: expected DEBUG, INFO, WARNING, ...")
        if self.event_loop not in EVENT_LOOPS:
            raise SettingsError(
                f"event_loop={self.event_loop!r}: expected {', '.join(EVENT_LOOPS)}"
            )
        try:
            validate_name("model", self.model)
            validate_name("worker", self.name)
        except InvalidName as exc:
            raise SettingsError(exc.message) from None
        _require_positive(self, "batch_size", "max_batch_tokens", "gpu_batch_size",
                          "gpu_max_batch_tokens", "max_deliveries", "heartbeat_s", "partitions",
                          "partition_block_tokens")  # fmt: skip
        _require_non_negative(
            self,
            "max_wait_ms",
            "anticipate_ms",
            "max_prompt_tokens",
            "cache_ttl_s",
            "max_backlog",
            "dead_consumer_idle_ms",
            "max_dead_letters",
            "malloc_mmap_threshold",
            "steal_after_ms",
        )
        if not 0 <= self.metrics_port <= 65535:
            raise SettingsError(f"metrics_port={self.metrics_port!r}: expected 0 to 65535")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> WorkerSettings:
        """Read ``LMQ_MODEL``, ``LMQ_BACKEND``, ``LMQ_BATCH_SIZE``, ...; `overrides` win."""
        values = _process_values(cls, environ, overrides)
        values.setdefault("model", "")
        return cls(**values)


@dataclass(frozen=True)
class ClientSettings:
    """Everything a `QueueLM` client needs."""

    redis: RedisSettings = field(default_factory=RedisSettings)
    #: Seconds from submission to a request's deadline; 0 waits forever.
    timeout_s: float = 120.0
    #: Dtype of result vectors on the wire; results are handed out as float32 (but see below).
    #: float16 and bfloat16 halve the bytes (bfloat16: float32's range, ~8x float16's error).
    wire_dtype: str = "float32"
    #: With ``wire_dtype="float16"``: hand results out as the float16 vectors they travelled as,
    #: not widened to float32 (the same values; the widening, done as each claimed vector
    #: arrives, is about a tenth of such a client's CPU a reply: BENCHMARKS.md, transport).
    #: For programs whose arithmetic on them is float16-safe.
    half_results: bool = False
    local_cache_size: int = 256
    use_shared_cache: bool = True
    #: Reuse the memory of freed vectors (glibc's thresholds, process-wide: shared/heap_reuse.py).
    heap_reuse: bool = True
    #: Collect young objects every this many allocations at least, not every 700 (process-wide,
    #: only raised: shared/gc_threshold.py); 0: leave the collector's thresholds alone.
    gc_young_threshold: int = 10_000
    max_inflight: int = 4096
    read_count: int = 256
    #: How long `connect` waits for a worker to publish the model.
    connect_timeout_s: float = 10.0
    #: Backlog bound for admission control; 0 uses the bound the model's workers publish.
    max_backlog: int = 0

    def __post_init__(self) -> None:
        if self.wire_dtype not in ("float32", "float16", "bfloat16"):
            raise SettingsError(
                f"wire_dtype={self.wire_dtype!r}: expected float32, float16 or bfloat16"
            )
        if self.half_results and self.wire_dtype != "float16":
            raise SettingsError(
                f"half_results needs wire_dtype='float16' (not {self.wire_dtype!r}): results "
                "are handed out as they travelled, and only float16 vectors travel as float16"
            )
        _require_positive(self, "max_inflight", "read_count")
        _require_non_negative(
            self, "timeout_s", "local_cache_size", "connect_timeout_s", "max_backlog",
            "gc_young_threshold",
        )  # fmt: skip

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> ClientSettings:
        """Read ``LMQ_TIMEOUT_S``, ``LMQ_WIRE_DTYPE``, ...; `overrides` win."""
        return cls(**_process_values(cls, environ, overrides))

    @classmethod
    def resolve(
        cls,
        settings: ClientSettings | None = None,
        redis_url: str | None = None,
        cache_url: str | None = None,
        **overrides: Any,
    ) -> ClientSettings:
        """The settings a client uses: `settings` (or the environment's), `redis_url`,
        `cache_url` and `overrides` on top. Resolved once per client; every way of connecting
        goes through here.

        Raises:
            SettingsError: for an override that names no field.
        """
        settings = settings or cls.from_env()
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise SettingsError(
                f"unknown client setting {', '.join(unknown)}: expected redis_url, cache_url "
                f"or one of {', '.join(sorted(known))}"
            )
        redis = overrides.get("redis", settings.redis)
        if redis_url is not None:
            redis = replace(redis, url=redis_url)
        if cache_url is not None:
            redis = replace(redis, cache_url=cache_url)
        overrides["redis"] = redis
        settings = replace(settings, **overrides)
        user = url_user(settings.redis.url)
        if user and user != "default" and user != settings.redis.tenant:
            # the tenant is the URL's ACL user: no second setting to keep in agreement
            settings = replace(settings, redis=replace(settings.redis, tenant=user))
        return settings


def _require_positive(settings: Any, *names: str) -> None:
    for name in names:
        if getattr(settings, name) <= 0:
            raise SettingsError(f"{name}={getattr(settings, name)!r}: must be > 0")


def _require_non_negative(settings: Any, *names: str) -> None:
    for name in names:
        if getattr(settings, name) < 0:
            raise SettingsError(f"{name}={getattr(settings, name)!r}: must be >= 0")


def _process_values(
    cls: type, environ: Mapping[str, str] | None, overrides: dict[str, Any]
) -> dict[str, Any]:
    """A process's settings (worker or client): its fields and its `RedisSettings` read from
    `environ` (default: the process's), then `overrides` on top."""
    environ = os.environ if environ is None else environ
    values = _from_environ(cls, environ, skip={"redis"})
    values["redis"] = RedisSettings.from_env(environ)
    return {**values, **overrides}


def _from_environ(cls: type, environ: Mapping[str, str], skip: set[str]) -> dict[str, Any]:
    """Values of `cls`'s fields found as ``LMQ_<FIELD>`` in `environ`, converted by type."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        key = ENV_PREFIX + f.name.upper()
        if f.name in skip or key not in environ:
            continue
        values[f.name] = _convert(key, environ[key], hints[f.name])
    return values


def _convert(key: str, raw: str, hint: Any) -> Any:
    """Convert one environment string by its field's type, naming key and value on failure."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
        if raw == "":
            return None
    try:
        if hint is bool:
            lowered = raw.strip().lower()
            if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError("expected a boolean")
            return lowered in ("1", "true", "yes", "on")
        if hint in (int, float, str):
            return hint(raw)
        if typing.get_origin(hint) is dict:
            value = json.loads(raw or "{}")
            if not isinstance(value, dict):
                raise ValueError("expected a JSON object")
            return value
    except ValueError as exc:
        raise SettingsError(f"{key}={raw!r}: {exc}") from None
    raise SettingsError(f"{key}: fields of type {hint!r} cannot be set from the environment")
