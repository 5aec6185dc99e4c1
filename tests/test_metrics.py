"""`WorkerMetrics`: names, labels and values in the text exposition, against a real HF backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lmqueue.shared.lm.vocab import decode_vocab
from lmqueue.workers.backends.hf import AsyncTransformer
from lmqueue.workers.metrics import WorkerMetrics, entry_enqueued_s, observe_many


def scrape(metrics: WorkerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the registry's text exposition, keyed by name and sorted labels."""
    text = generate_latest(metrics.registry).decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_counts_by_tenant_stay_right_when_the_kept_label_children_are_cleared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`WorkerMetrics` keeps each labelled child it used (`_child`) and clears them when
    more are kept than allowed: a child looked up again must count into the same series."""
    monkeypatch.setattr("lmqueue.workers.metrics._CHILDREN_KEPT", 2)
    metrics = WorkerMetrics("m1")
    for _ in range(3):
        for tenant in ("alice", "bob", "carol"):
            metrics.count_requests(tenant, "ok", 2)
            metrics.observe_replied(tenant, ["1700000000000-0"], now_s=1_700_000_000.5)
    assert len(metrics._children) <= 2
    samples = scrape(metrics)
    for tenant in ("alice", "bob", "carol"):
        assert value(samples, "lmq_requests_total", model="m1", tenant=tenant, outcome="ok") == 6
        assert value(samples, "lmq_e2e_request_seconds_count", model="m1", tenant=tenant) == 3


def test_entry_ids_carry_their_enqueue_time_in_milliseconds() -> None:
    assert entry_enqueued_s("1700000000123-7") == pytest.approx(1_700_000_000.123)


def test_counters_and_histograms_appear_with_their_labels_and_values() -> None:
    metrics = WorkerMetrics("m1")
    metrics.count_requests("alice", "ok", 3)
    metrics.count_requests("alice", "PromptTooLong")
    metrics.count_requests("bob", "ok", 0)  # nothing answered: no series
    metrics.count_dead_letters("alice", 2)
    metrics.observe_batch(requests=4, tokens=100)
    metrics.observe_forward(0.2)
    metrics.count_claim_checks(sent=5, missed=1)
    metrics.mark_heartbeat(now_s=1234.5)
    samples = scrape(metrics)
    assert value(samples, "lmq_requests_total", model="m1", tenant="alice", outcome="ok") == 3
    assert value(
        samples, "lmq_requests_total", model="m1", tenant="alice", outcome="PromptTooLong"
    ) == 1  # fmt: skip
    assert not any(k[0] == "lmq_requests_total" and ("tenant", "bob") in k[1] for k in samples)
    assert value(samples, "lmq_dead_letters_total", model="m1", tenant="alice") == 2
    assert value(samples, "lmq_batch_requests_count", model="m1") == 1
    assert value(samples, "lmq_batch_requests_sum", model="m1") == 4
    assert value(samples, "lmq_batch_requests_bucket", model="m1", le="4.0") == 1
    assert value(samples, "lmq_batch_requests_bucket", model="m1", le="2.0") == 0
    assert value(samples, "lmq_batch_tokens_sum", model="m1") == 100
    assert value(samples, "lmq_forward_seconds_sum", model="m1") == pytest.approx(0.2)
    assert value(samples, "lmq_claim_checks_total", model="m1") == 5
    assert value(samples, "lmq_claim_check_misses_total", model="m1") == 1
    assert value(samples, "lmq_heartbeat_timestamp_seconds", model="m1") == 1234.5
    assert value(samples, "process_resident_memory_bytes") > 1 << 20
    assert metrics.requests_total == 4 and metrics.batches_total == 1


def test_waits_are_measured_from_the_entry_ids_timestamps() -> None:
    metrics = WorkerMetrics("m1", process_metrics=False)
    metrics.observe_queue_wait("t", ["1000000-0", "1000500-3"], now_s=1001.0)
    metrics.observe_replied("t", ["1000000-0"], now_s=1003.0)
    metrics.observe_replied("t", ["1004000-0"], now_s=1003.0)  # a skewed clock: clamped at 0
    samples = scrape(metrics)
    assert value(samples, "lmq_queue_wait_seconds_sum", model="m1", tenant="t") == 1.5
    assert value(samples, "lmq_queue_wait_seconds_count", model="m1", tenant="t") == 2
    assert value(samples, "lmq_e2e_request_seconds_sum", model="m1", tenant="t") == 3.0
    assert value(samples, "lmq_e2e_request_seconds_bucket", model="m1", tenant="t", le="0.001") == 1


def test_observing_many_at_once_exports_what_observing_each_does() -> None:
    amounts = [0.0, 0.001, 0.0011, 0.0049, 0.05, 0.05, 7.0, 61.0, 1e9, 0.3]
    one_by_one, at_once = WorkerMetrics("m", process_metrics=False), WorkerMetrics("m")
    for amount in amounts:
        one_by_one._e2e.labels("m", "t").observe(amount)
    observe_many(at_once._e2e.labels("m", "t"), amounts)
    observe_many(at_once._e2e.labels("m", "t"), [])

    def e2e(metrics: WorkerMetrics) -> dict:
        samples = scrape(metrics).items()
        return {k: v for k, v in samples if k[0].startswith("lmq_e2e") and "created" not in k[0]}

    ours, theirs = e2e(at_once), e2e(one_by_one)
    assert ours == theirs and len(ours) == 18  # 16 buckets, sum and count
    assert value(ours, "lmq_e2e_request_seconds_bucket", model="m", tenant="t", le="0.005") == 4


def test_a_histogram_of_another_layout_is_observed_one_by_one() -> None:
    class Plain:
        def __init__(self) -> None:
            self.seen: list[float] = []

        def observe(self, amount: float) -> None:
            self.seen.append(amount)

    plain = Plain()
    observe_many(plain, [0.5, 2.0])
    assert plain.seen == [0.5, 2.0]


def test_two_workers_in_one_process_keep_separate_registries() -> None:
    first, second = WorkerMetrics("m"), WorkerMetrics("m")
    first.count_requests("t", "ok", 2)
    assert value(scrape(first), "lmq_requests_total", model="m", tenant="t", outcome="ok") == 2
    assert ("lmq_requests_total", (("model", "m"), ("outcome", "ok"), ("tenant", "t"))) not in (
        scrape(second)
    )


def test_rates_cover_the_last_minute() -> None:
    metrics = WorkerMetrics("m", process_metrics=False)
    assert metrics.rates(now_s=0.0) == (0.0, 0.0)
    for _ in range(10):
        metrics.observe_batch(4, 40)
        metrics.count_requests("t", "ok", 4)
    batches_per_s, requests_per_s = metrics.rates(now_s=5.0)
    assert (batches_per_s, requests_per_s) == (2.0, 8.0)
    assert metrics.rates(now_s=50.0)[0] == pytest.approx(10 / 50)  # none since: the rate falls
    assert metrics.rates(now_s=200.0) == (0.0, 0.0)  # the window moved past every batch


def test_shared_cache_counts_without_a_backend_show_only_the_shared_cache() -> None:
    metrics = WorkerMetrics("m", process_metrics=False)
    metrics.count_shared_cache(hits=3, misses=7)
    samples = scrape(metrics)
    assert value(samples, "lmq_output_cache_hits_total", model="m", cache="shared") == 3
    assert value(samples, "lmq_output_cache_misses_total", model="m", cache="shared") == 7
    assert not any(name.startswith("lmq_kv_cache") for name, _ in samples)
    assert metrics.shared_cache_counts() == (3, 7)


@pytest.fixture
async def hf_backend(tiny_model_dir: Path, smol_tokenizer: Any) -> Any:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_model_dir)
    byte_vocab, str_vocab = decode_vocab(smol_tokenizer)
    lm = AsyncTransformer(
        model, smol_tokenizer, byte_vocab=byte_vocab, str_vocab=str_vocab, max_kv_tokens=64
    )
    yield lm
    await lm.aclose()


async def test_kv_reuse_local_hits_and_kv_memory_are_read_from_the_hf_backend(hf_backend) -> None:
    metrics = WorkerMetrics("tiny", process_metrics=False)
    metrics.watch_backend(hf_backend)
    await hf_backend.next_token_logprobs([1, 2, 3, 4])
    await hf_backend.next_token_logprobs([1, 2, 3, 4, 5, 6])  # reuses the first four positions
    await hf_backend.next_token_logprobs([1, 2, 3, 4])  # a stored result
    samples = scrape(metrics)
    assert value(samples, "lmq_tokens_total", model="tiny", kind="computed") == 4 + 2
    assert value(samples, "lmq_tokens_total", model="tiny", kind="reused") == 4
    assert value(samples, "lmq_output_cache_hits_total", model="tiny", cache="local") == 1
    assert value(samples, "lmq_output_cache_misses_total", model="tiny", cache="local") == 2
    assert value(samples, "lmq_kv_cache_tokens", model="tiny") == 6
    assert value(samples, "lmq_kv_cache_max_tokens", model="tiny") == 64
    # two layers x (K, V) x 2 kv heads x 16 head dims x 4 bytes = 512 bytes a position
    assert value(samples, "lmq_kv_cache_bytes", model="tiny") == 6 * 512
