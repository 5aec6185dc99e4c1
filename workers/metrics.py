"""`WorkerMetrics`: what one worker exposes to Prometheus, on a registry of its own.

Every metric starts with ``lmq_``, is in base units, and carries only bounded labels: `model`,
`tenant`, `outcome` (``ok`` or an error's class name from `shared.errors`), `kind` and `cache`
(``local``: the backend's own result cache; ``shared``: the cache-role Redis). Client ids and
prompts never become labels.

    lmq_requests_total{model,tenant,outcome}        requests answered (one reply each)
    lmq_dead_letters_total{model,tenant}            entries moved to the dead-letter stream
    lmq_batch_requests{model}                       histogram: entries per batch read
    lmq_batch_tokens{model}                         histogram: prompt tokens of a batch's admitted
                                                    requests (refused ones cost no compute)
    lmq_forward_seconds{model}                      histogram: a batch's compute (backend) time
    lmq_queue_wait_seconds{model,tenant}            histogram: enqueue -> start of compute
    lmq_e2e_request_seconds{model,tenant}           histogram: enqueue -> reply written
    lmq_tokens_total{model,kind}                    prompt positions: kind=computed|reused (KV)
    lmq_output_cache_hits_total{model,cache}        results found in a cache
    lmq_output_cache_misses_total{model,cache}      results looked up and not found
    lmq_claim_checks_total{model}                   results sent as claim-checks
    lmq_claim_check_misses_total{model}             claim-checks wanted, sent inline instead
                                                    (the cache entry was not stored)
    lmq_kv_cache_tokens{model}                      KV positions held for reuse
    lmq_kv_cache_max_tokens{model}                  their bound
    lmq_kv_cache_bytes{model}                       bytes those positions take
    lmq_heartbeat_timestamp_seconds{model}          Unix time of the last heartbeat written
    lmq_partitions_owned{model}                     request stream partitions this worker owns
    lmq_stolen_entries_total{model}                 entries taken from partitions it does not own
    lmq_cluster_rebuilds_total{model}               Redis Cluster clients rebuilt after losing
                                                    every node (shared.cluster_client)
    lmq_cluster_rebuilding{model}                   1 while such a rebuild is under way
    process_resident_memory_bytes, ...              the standard process collector (RSS, CPU)

Enqueue times come from stream entry ids, which are Redis's millisecond clock at XADD: the
waits are measured against this host's clock, so clock skew between the worker and the queue
Redis shifts them (NTP keeps that to milliseconds).
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from lmqueue.shared.lm.interface import BackendCounters

__all__ = ["WorkerMetrics", "entry_enqueued_s", "observe_many"]

_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144)
_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_RATE_WINDOW_S = 60.0
#: Labelled metric children kept by `WorkerMetrics._child`; cleared when full.
_CHILDREN_KEPT = 4096


def entry_enqueued_s(entry_id: str) -> float:
    """The Unix time (s) at which a stream entry was added: its id's millisecond part."""
    return int(entry_id.partition("-")[0]) / 1000


class WorkerMetrics:
    """The metrics of one worker serving `model`; methods are named for what the worker did.

    Args:
        model: the model's name, the `model` label of every metric.
        registry: where to register; a fresh `CollectorRegistry` by default (never the global
            one, so several workers or tests can live in one process).
        process_metrics: add the standard process collector (RSS, CPU seconds, open fds).
    """

    def __init__(
        self, model: str, registry: CollectorRegistry | None = None, process_metrics: bool = True
    ) -> None:
        self.model = model
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        reg = self.registry
        self._requests = Counter(
            "lmq_requests", "Requests answered, by outcome (ok or the error's class name).",
            ["model", "tenant", "outcome"], registry=reg,
        )  # fmt: skip
        self._dead = Counter(
            "lmq_dead_letters", "Entries moved to the dead-letter stream.",
            ["model", "tenant"], registry=reg,
        )  # fmt: skip
        self._batch_requests = Histogram(
            "lmq_batch_requests", "Entries per batch read from the request streams.",
            ["model"], buckets=_SIZE_BUCKETS, registry=reg,
        )  # fmt: skip
        self._batch_tokens = Histogram(
            "lmq_batch_tokens", "Prompt tokens of the admitted requests of a batch.",
            ["model"], buckets=_TOKEN_BUCKETS, registry=reg,
        )  # fmt: skip
        self._forward = Histogram(
            "lmq_forward_seconds", "Time a batch spent computing in the backend.",
            ["model"], buckets=_SECONDS_BUCKETS, registry=reg,
        )  # fmt: skip
        self._queue_wait = Histogram(
            "lmq_queue_wait_seconds", "From enqueue (XADD) to the start of compute.",
            ["model", "tenant"], buckets=_SECONDS_BUCKETS, registry=reg,
        )  # fmt: skip
        self._e2e = Histogram(
            "lmq_e2e_request_seconds", "From enqueue (XADD) to the reply written.",
            ["model", "tenant"], buckets=_SECONDS_BUCKETS, registry=reg,
        )  # fmt: skip
        self._claims = Counter(
            "lmq_claim_checks", "Results sent as claim-checks (a shared-cache key).",
            ["model"], registry=reg,
        )  # fmt: skip
        self._claim_misses = Counter(
            "lmq_claim_check_misses",
            "Claim-checks wanted but sent inline: the cache entry was not stored.",
            ["model"], registry=reg,
        )  # fmt: skip
        self._heartbeat = Gauge(
            "lmq_heartbeat_timestamp_seconds", "Unix time of the last heartbeat written to Redis.",
            ["model"], registry=reg,
        )  # fmt: skip
        self._owned = Gauge(
            "lmq_partitions_owned", "Request stream partitions this worker owns.",
            ["model"], registry=reg,
        )  # fmt: skip
        self._stolen = Counter(
            "lmq_stolen_entries", "Entries taken from partitions other workers own.",
            ["model"], registry=reg,
        )  # fmt: skip
        self._backend = _BackendCollector(model)
        reg.register(self._backend)
        if process_metrics:
            ProcessCollector(registry=reg)
        self.batches_total = 0
        self.requests_total = 0
        self._rate_samples: deque[tuple[float, int, int]] = deque()
        #: Labelled children by metric and labels (`_child`).
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(model, *labels)``, looked up once: prometheus_client validates and
        locks at every ``labels`` call, ~8 of them a batch on the worker's loop and writer."""
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            if len(self._children) >= _CHILDREN_KEPT:  # tenants come and go
                self._children.clear()
            child = self._children[key] = metric.labels(self.model, *labels)
        return child

    # -- what the worker calls ---------------------------------------------------------------
    def observe_batch(self, requests: int, tokens: int) -> None:
        """A batch of `requests` entries was read; its admitted prompts hold `tokens` tokens."""
        self._child(self._batch_requests).observe(requests)
        self._child(self._batch_tokens).observe(tokens)
        self.batches_total += 1

    def observe_forward(self, seconds: float) -> None:
        """A batch's prompts took `seconds` in the backend."""
        self._child(self._forward).observe(seconds)

    def observe_queue_wait(
        self, tenant: str, entry_ids: Iterable[str], now_s: float | None = None
    ) -> None:
        """Compute starts now for `entry_ids`: record how long each waited since its XADD."""
        self._observe_since(self._child(self._queue_wait, tenant), entry_ids, now_s)

    def observe_replied(
        self, tenant: str, entry_ids: Iterable[str], now_s: float | None = None
    ) -> None:
        """The replies to `entry_ids` were written: record each one's time since its XADD."""
        self._observe_since(self._child(self._e2e, tenant), entry_ids, now_s)

    def count_requests(self, tenant: str, outcome: str, n: int = 1) -> None:
        """`n` requests of `tenant` were answered with `outcome` (``ok`` or an error class)."""
        if n:
            self._child(self._requests, tenant, outcome).inc(n)
            self.requests_total += n

    def count_dead_letters(self, tenant: str, n: int = 1) -> None:
        """`n` entries of `tenant` went to the dead-letter stream."""
        if n:
            self._child(self._dead, tenant).inc(n)

    def observe_partitions(self, owned: int, stolen: int = 0) -> None:
        """The worker owns `owned` partitions and took `stolen` more entries from others'."""
        self._owned.labels(self.model).set(owned)
        if stolen:
            self._stolen.labels(self.model).inc(stolen)

    def count_shared_cache(self, hits: int, misses: int) -> None:
        """One lookup in the shared (cache-role) output cache found `hits` of its keys."""
        self._backend.shared_hits += hits
        self._backend.shared_misses += misses

    def count_claim_checks(self, sent: int, missed: int) -> None:
        """`sent` results went out as claim-checks, `missed` inline though claims were wanted."""
        if sent:
            self._child(self._claims).inc(sent)
        if missed:
            self._child(self._claim_misses).inc(missed)

    def mark_heartbeat(self, now_s: float | None = None) -> None:
        """A heartbeat was written."""
        self._heartbeat.labels(self.model).set(time.time() if now_s is None else now_s)

    def watch_cluster(self, state: Callable[[], tuple[int, bool]]) -> None:
        """Export ``lmq_cluster_rebuilds_total`` and ``lmq_cluster_rebuilding`` from `state`
        (rebuilds so far, one under way: `shared.cluster_client.cluster_rebuilds`)."""
        self.registry.register(_ClusterCollector(self.model, state))

    def watch_backend(self, backend: Any) -> None:
        """Read KV and local-cache figures from `backend` at each scrape (`AsyncLM.counters`:
        the series a backend keeps no counter for are not exported)."""
        self._backend.backend = backend

    # -- for the worker's stats hash (lmq status) --------------------------------------------
    def rates(self, now_s: float | None = None) -> tuple[float, float]:
        """Batches and requests per second over about the last minute."""
        now_s = time.monotonic() if now_s is None else now_s
        samples = self._rate_samples
        samples.append((now_s, self.batches_total, self.requests_total))
        while len(samples) > 2 and now_s - samples[1][0] >= _RATE_WINDOW_S:
            samples.popleft()
        first_s, first_batches, first_requests = samples[0]
        elapsed_s = now_s - first_s
        if elapsed_s <= 0:
            return 0.0, 0.0
        return (
            (self.batches_total - first_batches) / elapsed_s,
            (self.requests_total - first_requests) / elapsed_s,
        )

    def shared_cache_counts(self) -> tuple[int, int]:
        """Hits and misses in the shared cache so far."""
        return self._backend.shared_hits, self._backend.shared_misses

    @staticmethod
    def _observe_since(histogram: Any, entry_ids: Iterable[str], now_s: float | None) -> None:
        now_s = time.time() if now_s is None else now_s
        observe_many(histogram, [max(now_s - entry_enqueued_s(e), 0.0) for e in entry_ids])


def observe_many(histogram: Any, amounts: Sequence[float]) -> None:
    """`histogram.observe` of every amount, with one increment of its sum and of each bucket
    hit instead of one of each an amount: a batch's waits were ~4% of the worker's CPU in
    ``lmq bench transport`` (a lock and a bucket search an observation). Reads the child's
    bounds and values as prometheus_client 0.26 keeps them; any other layout observes one by
    one (`tests/test_metrics.py` compares the two)."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for amount in amounts:
            histogram.observe(amount)
        return
    if not amounts:
        return
    hits: dict[int, int] = {}
    for amount in amounts:
        index = bisect.bisect_left(bounds, amount)  # the first bound >= amount, as observe
        hits[index] = hits.get(index, 0) + 1
    total.inc(sum(amounts))
    for index, n in hits.items():
        buckets[index].inc(n)


class _BackendCollector(Collector):
    """Metrics read at scrape time: the backend's counters and the output-cache counts."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.backend: Any = None
        self.shared_hits = 0
        self.shared_misses = 0

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        tokens, hits, misses, kv_tokens, kv_max, kv_bytes = families
        labels = [self.model]
        hits.add_metric([self.model, "shared"], self.shared_hits)
        misses.add_metric([self.model, "shared"], self.shared_misses)
        backend = self.backend
        counters = backend.counters() if backend is not None else BackendCounters()
        if counters.reused_tokens is not None:
            tokens.add_metric([self.model, "computed"], counters.computed_tokens)
            tokens.add_metric([self.model, "reused"], counters.reused_tokens)
        if counters.result_hits is not None:
            hits.add_metric([self.model, "local"], counters.result_hits)
            misses.add_metric([self.model, "local"], counters.result_misses)
        if counters.kv_tokens is not None:
            kv_tokens.add_metric(labels, counters.kv_tokens)
            kv_max.add_metric(labels, counters.max_kv_tokens)
            kv_bytes.add_metric(labels, counters.kv_bytes)
        return iter(families)

    @staticmethod
    def _families() -> tuple[Any, ...]:
        return (
            CounterMetricFamily(
                "lmq_tokens", "Prompt positions: computed, or reused from the KV cache.",
                labels=["model", "kind"],
            ),
            CounterMetricFamily(
                "lmq_output_cache_hits", "Results found in an output cache (local or shared).",
                labels=["model", "cache"],
            ),
            CounterMetricFamily(
                "lmq_output_cache_misses", "Results looked up in an output cache and not found.",
                labels=["model", "cache"],
            ),
            GaugeMetricFamily(
                "lmq_kv_cache_tokens", "KV positions held for reuse.", labels=["model"]
            ),
            GaugeMetricFamily(
                "lmq_kv_cache_max_tokens", "Bound on the KV positions held.", labels=["model"]
            ),
            GaugeMetricFamily(
                "lmq_kv_cache_bytes", "Bytes of the KV positions held.", labels=["model"]
            ),
        )  # fmt: skip


class _ClusterCollector(Collector):
    """Rebuilds of the worker's Redis Cluster clients, read at scrape time."""

    def __init__(self, model: str, state: Callable[[], tuple[int, bool]]) -> None:
        self.model = model
        self.state = state

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        rebuilds, rebuilding = self.state()
        total, now = self._families()
        total.add_metric([self.model], rebuilds)
        now.add_metric([self.model], int(rebuilding))
        return iter((total, now))

    @staticmethod
    def _families() -> tuple[CounterMetricFamily, GaugeMetricFamily]:
        return (
            CounterMetricFamily(
                "lmq_cluster_rebuilds",
                "Times a Redis Cluster client lost every node and was rebuilt from known ones.",
                labels=["model"],
            ),
            GaugeMetricFamily(
                "lmq_cluster_rebuilding",
                "1 while a Redis Cluster client is being rebuilt (no node reachable yet).",
                labels=["model"],
            ),
        )
