"""The whole Redis key layout, in one place.

Every key starts with a prefix (default ``lmq``). Keys a tenant owns carry the tenant as their
second part, so that ACL rules (``~lmq:<tenant>:*``, see `KeyPatterns`) isolate tenants; the
single-tenant default is ``default``. Keys that describe a model served to everyone (its
registry entry, tokenizer, vocabulary, live workers) carry no tenant.

    lmq:models                                    set of published model names
    lmq:model:{<model>}:info                      msgpack map: revision, vocab size, context, ...
    lmq:model:{<model>}:tokenizer                 the tokenizer's JSON (tokenizers library)
    lmq:model:{<model>}:vocab                     msgpack list of every token's bytes
    lmq:model:{<model>}:workers                   zset: worker name -> last heartbeat (ms)
    lmq:model:{<model>}:adapters                  hash: LoRA adapter name -> msgpack record
                                                  (shared/adapters.py), every adapter of the
                                                  model: workers and the operator read it
    lmq:model:{<model>}:public-adapters           the public ones' records (tenants read it)
    lmq:model:{<model>}:worker:<worker>           hash: one worker's stats for `lmq status`
                                                  (shared/worker_stats.py; expires)
    lmq:tenants                                   hash: tenant -> JSON config (operator writes)
    lmq:<tenant>:model:{<model>}:requests         request stream (consumer group "workers")
    lmq:<tenant>:model:{<model>}:quota            hash of the tenant's limits (workers mirror)
    lmq:<tenant>:model:{<model>}:rate             token-rate bucket (the admission script)
    lmq:<tenant>:model:{<model>:<p>}:requests     the same three for partition p of a model
    lmq:<tenant>:model:{<model>:<p>}:quota        published with N > 1 partitions
    lmq:<tenant>:model:{<model>:<p>}:rate         (shared/partitions.py); p = 0 .. N-1
    lmq:<tenant>:model:{<model>}:dead             dead-letter stream (workers only)
    lmq:<tenant>:model:{<model>}:adapters         the tenant's private adapters' records
                                                  (copies: the tenant reads its own alone)
    lmq:<tenant>:client:{<client>}:replies        one reply stream per client (expires)
    lmq:<ns>:cache:<model>:<rev>:<kind>:<digest>  one cached result vector; ns is the tenant
                                                  or a shared ``pool.<name>`` it opted into
    lmq:<ns>:cache:<model>:<rev>~<adapter>@<arev>:<kind>:<digest>
                                                  the same under a LoRA adapter (its revision);
                                                  a private adapter's always in its tenant's ns
    lmq:<tenant>:exp:inbox                        experiment orders the scheduler reads
    lmq:<tenant>:exp:index                        zset: experiment id -> submission (ms)
    lmq:<tenant>:exp:{<tenant>:<id>}:record       hash: one experiment's kind, status, progress
    lmq:<tenant>:exp:{<tenant>:<id>}:results      list of result rows (JSON), same slot
    lmq:_sched:running:<tenant>                   zset: the tenant's running experiments (leases)
    lmq:_sched:queue                              the scheduler's arq queue (arq:* keys are arq's)

The ``_sched`` and ``arq:*`` keys are the scheduler's control plane: they live on its control
instance (``--control-url``, always a single instance; by default the queue's own Redis), the
``exp`` keys on the queue's Redis with the rest (`scheduler.planes`).

Redis Cluster hashes only the text between the first ``{`` and the next ``}`` of a key (a hash
tag), and refuses multi-key commands, transactions and Lua scripts whose keys span slots
(CROSSSLOT). Names cannot contain braces (`validate_name`), so the only tags are these:

- ``{<model>}`` in every tenant's request stream of a model and its quota, rate and
  dead-letter keys: one XREADGROUP reads all tenants' streams of the model, and the admission
  script touches one slot. A model split into partitions has ``{<model>:<p>}`` instead on
  each partition's request stream, quota copy and rate bucket: one XREADGROUP reads every
  tenant's stream of a partition, admission stays in one slot, and partitions (the unit of
  worker affinity) spread over the cluster's masters. Dead letters stay one stream per
  tenant and model (written by a plain pipeline, never with the stream).
- ``{<model>}`` in the registry keys of a model (info, tokenizer, vocab, workers): a worker
  publishes info, tokenizer and vocabulary in one Lua script (`shared.registry`), so a client
  never reads a new revision's info beside an old tokenizer. ``lmq:models`` is written after
  it, on its own (a set that names every model cannot share every model's slot).
- ``{<model>}`` in the three hashes of a model's adapter records (all, public, each tenant's
  private ones): one Lua script moves a record between them (`shared.adapter_views`), so a
  record is always in the full hash and in exactly one of the views.
- ``{<client>}`` in a reply stream: each client's replies are one slot of their own.
- ``{<tenant>:<id>}`` in an experiment's record and results: a checkpoint writes both in one
  Lua script (`scheduler.context`).
- Every other command touches one key at a time (the janitor's scripts) or is a non-atomic
  pipeline, which redis-py splits per node.
- Cache keys carry no tag on purpose: their digests spread them over all 16,384 slots, so the
  cache's memory and bandwidth grow with the number of masters. Multi-key reads of them (the
  shared cache's and the claim resolver's MGET) are split per node and sent concurrently in
  cluster mode (`shared.connections.multi_get`).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from .errors import InvalidName

__all__ = [
    "KeySpace",
    "KeyPatterns",
    "WORKER_GROUP",
    "arq_in_progress",
    "validate_name",
    "validate_client_id",
    "token_digest",
]

#: The consumer group every worker of a model joins on its request stream.
WORKER_GROUP = "workers"

_NAME = re.compile(r"^[A-Za-z0-9._/@+=-]{1,200}$")
_CLIENT_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def validate_name(kind: str, name: str) -> str:
    """Return `name` if it is safe inside a key, else raise `InvalidName` naming `kind`."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidName(f"invalid {kind} name {name!r}: use 1-200 of A-Z a-z 0-9 . _ / @ + = -")
    return name


def validate_client_id(client_id: str) -> str:
    """Return `client_id` if it may name a reply stream, else raise `InvalidName`.

    Stricter than model names: it comes from the wire, and a worker writes to the key it names.
    """
    if not isinstance(client_id, str) or not _CLIENT_ID.match(client_id):
        raise InvalidName(f"invalid client id {client_id!r}: use 1-64 of A-Z a-z 0-9 _ -")
    return client_id


def token_digest(token_bytes: bytes) -> str:
    """A 160-bit digest of a prompt's little-endian token bytes: the exact token tuple, short."""
    return hashlib.blake2b(token_bytes, digest_size=20).hexdigest()


@dataclass(frozen=True)
class KeySpace:
    """Builds every key name from a prefix, a tenant and its cache namespace.

    `cache_namespace` is the first part of cached vectors' keys: empty means the tenant's own.
    """

    prefix: str = "lmq"
    tenant: str = "default"
    cache_namespace: str = ""

    def __post_init__(self) -> None:
        validate_name("prefix", self.prefix)
        validate_name("tenant", self.tenant)
        if self.cache_namespace:
            validate_name("cache namespace", self.cache_namespace)

    def for_tenant(self, tenant: str, cache_namespace: str = "") -> KeySpace:
        """The same layout for another tenant (a worker serves them all)."""
        return KeySpace(self.prefix, tenant, cache_namespace)

    # -- model registry (global) -------------------------------------------------------------
    def models(self) -> str:
        """The set of model names any worker ever published."""
        return f"{self.prefix}:models"

    def model_info(self, model: str) -> str:
        """The model's published metadata."""
        return f"{self.prefix}:model:{{{model}}}:info"

    def model_tokenizer(self, model: str) -> str:
        """The model's tokenizer as tokenizers-library JSON."""
        return f"{self.prefix}:model:{{{model}}}:tokenizer"

    def model_vocab(self, model: str) -> str:
        """The model's byte vocabulary."""
        return f"{self.prefix}:model:{{{model}}}:vocab"

    def model_workers(self, model: str) -> str:
        """The zset of live workers of the model, scored by last heartbeat (ms)."""
        return f"{self.prefix}:model:{{{model}}}:workers"

    def model_adapters(self, model: str) -> str:
        """The hash of every LoRA adapter record of the model (`shared.adapters`): what workers
        serve. No tenant reads it; each reads the public view and its own private one."""
        return f"{self.prefix}:model:{{{model}}}:adapters"

    def public_adapters(self, model: str) -> str:
        """The hash of the model's public adapters' records, a view every tenant reads."""
        return f"{self.prefix}:model:{{{model}}}:public-adapters"

    def worker_stats(self, model: str, worker: str) -> str:
        """The hash of one worker's recent figures (what it serves, batches/s), for operators."""
        return f"{self.prefix}:model:{{{model}}}:worker:{worker}"

    def tenants(self) -> str:
        """The hash of tenant name -> JSON config, written by the operator (``lmq tenant``)."""
        return f"{self.prefix}:tenants"

    # -- per tenant ----------------------------------------------------------------------------
    def requests(self, model: str, partition: int | None = None) -> str:
        """The tenant's request stream of the model (of one partition, if it has several)."""
        return f"{self.prefix}:{self.tenant}:model:{_stream_tag(model, partition)}:requests"

    def dead_letters(self, model: str) -> str:
        """The tenant's dead-letter stream of the model."""
        return f"{self.prefix}:{self.tenant}:model:{{{model}}}:dead"

    def private_adapters(self, model: str) -> str:
        """The hash of the tenant's private adapters' records of the model (a view: copies of
        their records in `model_adapters`), which only the tenant (and workers) may read."""
        return f"{self.prefix}:{self.tenant}:model:{{{model}}}:adapters"

    def replies(self, client_id: str) -> str:
        """The reply stream of one client of the tenant."""
        return f"{self.prefix}:{self.tenant}:client:{{{client_id}}}:replies"

    def cache_entry(
        self,
        model: str,
        revision: str,
        kind: str,
        token_bytes: bytes,
        adapter_tag: str = "",
        own_namespace: bool = False,
    ) -> str:
        """The shared-cache key of one result: model, revision, adapter, result kind, tokens.

        `adapter_tag` names a LoRA adapter and its revision (``name@rev``); `own_namespace`
        keeps the key in the tenant's own namespace even if it shares a pool (a private
        adapter's rows are never pooled).
        """
        prefix = self.cache_prefix(model, revision, kind, adapter_tag, own_namespace)
        return prefix + token_digest(token_bytes)

    def cache_prefix(
        self,
        model: str,
        revision: str,
        kind: str,
        adapter_tag: str = "",
        own_namespace: bool = False,
    ) -> str:
        """What `cache_entry`'s keys of these arguments start with: all but the tokens'
        digest (`shared.shared_cache.SharedCache` keeps its base model's, one a dtype)."""
        namespace = self.tenant if own_namespace else self.cache_namespace or self.tenant
        weights = f"{revision}~{adapter_tag}" if adapter_tag else revision
        return f"{self.prefix}:{namespace}:cache:{model}:{weights}:{kind}:"

    def quota(self, model: str, partition: int | None = None) -> str:
        """The tenant's limits for the model (hash), read by its admission script.

        Each partition's admission reads a copy in its own slot (workers mirror them all).
        """
        return f"{self.prefix}:{self.tenant}:model:{_stream_tag(model, partition)}:quota"

    def quota_copies(self, model: str, partitions: int) -> list[str]:
        """The tenant's quota hash of the model and, if it has partitions, each one's copy."""
        copies = [self.quota(model, p) for p in range(partitions)] if partitions > 1 else []
        return [self.quota(model), *copies]

    def rate(self, model: str, partition: int | None = None) -> str:
        """The tenant's token-rate bucket for the model (per partition), for admission."""
        return f"{self.prefix}:{self.tenant}:model:{_stream_tag(model, partition)}:rate"

    # -- experiments (the scheduler) ---------------------------------------------------------
    def experiment_kinds(self) -> str:
        """The kinds the schedulers run and their parameters (JSON), in the registry."""
        return f"{self.prefix}:experiment-kinds"

    def experiment_inbox(self) -> str:
        """The stream of experiment orders (submissions) the scheduler reads."""
        return f"{self.prefix}:{self.tenant}:exp:inbox"

    def experiment_index(self) -> str:
        """The zset of the tenant's experiment ids, scored by submission time (ms)."""
        return f"{self.prefix}:{self.tenant}:exp:index"

    def experiment_record(self, experiment_id: str) -> str:
        """One experiment's hash; its `{tenant:id}` tag puts it in its results' slot."""
        return f"{self.prefix}:{self.tenant}:exp:{{{self.tenant}:{experiment_id}}}:record"

    def experiment_results(self, experiment_id: str) -> str:
        """One experiment's result rows (a list of JSON documents)."""
        return f"{self.prefix}:{self.tenant}:exp:{{{self.tenant}:{experiment_id}}}:results"

    def experiments_running(self) -> str:
        """The scheduler's zset of the tenant's running experiments (member -> lease end, ms).

        Under ``_sched``, which no tenant name can be, so no tenant's key pattern covers it.
        """
        return f"{self.prefix}:_sched:running:{self.tenant}"

    def experiment_job_id(self, experiment_id: str) -> str:
        """The arq job id of an experiment: tenant-scoped, so one id runs once per tenant."""
        return f"{self.prefix}:{self.tenant}:{experiment_id}"

    def scheduler_queue(self) -> str:
        """The arq queue (a zset arq owns) the scheduler's jobs wait in."""
        return f"{self.prefix}:_sched:queue"


@dataclass(frozen=True)
class KeyPatterns:
    """The key layout as ACL glob patterns: one tenant's keys, or every tenant's (``"*"``).

    Names never hold a glob character (`validate_name`), so a tenant's patterns begin with
    ``<prefix>:<tenant>:`` and match no other tenant's keys.
    """

    prefix: str = "lmq"
    tenant: str = "*"

    def __post_init__(self) -> None:
        validate_name("prefix", self.prefix)
        if self.tenant != "*":
            validate_name("tenant", self.tenant)

    def registry(self) -> list[str]:
        """What clients read to use a model: the model set, info, tokenizer, vocabulary, public
        adapters (never every adapter's record: `private_adapters` has a tenant's own)."""
        model = f"{self.prefix}:model:*"
        return [
            f"{self.prefix}:models", f"{model}:info", f"{model}:tokenizer", f"{model}:vocab",
            f"{model}:public-adapters", f"{self.prefix}:experiment-kinds",
        ]  # fmt: skip

    def registry_all(self) -> list[str]:
        """Every registry key, the workers' live sets included (what workers write)."""
        return [f"{self.prefix}:models", f"{self.prefix}:model:*"]

    def tenants(self) -> str:
        """The tenants hash."""
        return f"{self.prefix}:tenants"

    def private_adapters(self) -> str:
        """The tenant's private adapters' records, of every model."""
        return f"{self.prefix}:{self.tenant}:model:*:adapters"

    def adapter_records(self) -> list[str]:
        """Every hash of adapter records: each model's full hash and public view, and the
        private views (of the tenant; of every tenant with ``"*"``)."""
        model = f"{self.prefix}:model:*"
        return [f"{model}:adapters", f"{model}:public-adapters", self.private_adapters()]

    def requests(self) -> str:
        """Request streams of every model."""
        return f"{self.prefix}:{self.tenant}:model:*:requests"

    def quota(self) -> str:
        """Quota hashes of every model."""
        return f"{self.prefix}:{self.tenant}:model:*:quota"

    def rate(self) -> str:
        """Rate buckets of every model."""
        return f"{self.prefix}:{self.tenant}:model:*:rate"

    def dead_letters(self) -> str:
        """Dead-letter streams of every model."""
        return f"{self.prefix}:{self.tenant}:model:*:dead"

    def replies(self) -> str:
        """Reply streams of every client."""
        return f"{self.prefix}:{self.tenant}:client:*:replies"

    def experiments(self) -> str:
        """Experiment keys: inbox, index, records and results (`producer.Experiments`)."""
        return f"{self.prefix}:{self.tenant}:exp:*"

    def cache(self, namespace: str | None = None) -> str:
        """Cached vectors of one cache namespace (default: the tenant's own; ``*``: all)."""
        return f"{self.prefix}:{namespace or self.tenant}:cache:*"


def _stream_tag(model: str, partition: int | None) -> str:
    """The hash tag of a request stream and its admission keys: ``{<model>}`` for a model
    with one stream, ``{<model>:<partition>}`` for each of several (names hold no colon)."""
    return f"{{{model}}}" if partition is None else f"{{{model}:{partition}}}"


#: arq's key of a running job (fixed by arq, whatever the queue): ``arq:in-progress:<job id>``.
#: The scheduler shortens and renews its expiry, so a killed scheduler's job is retried soon.
ARQ_IN_PROGRESS_PREFIX = "arq:in-progress:"


def arq_in_progress(job_id: str) -> str:
    """arq's in-progress key of `job_id` (``arq.constants.in_progress_key_prefix``)."""
    return ARQ_IN_PROGRESS_PREFIX + job_id
