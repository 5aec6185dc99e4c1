"""What the memory benchmark measures and what it compares against.

`MemorySampler` reads a worker's RSS and Redis instances' ``used_memory`` on a thread, so a
busy event loop never delays a sample. `derive_bounds` turns the worker's configured limits
into bytes:

* KV: ``max_kv_tokens`` x bytes of KV per token position (2 x layers x KV heads x head
  dimension x element size: 45 KiB for SmolLM2-135M in float32);
* results: ``cache_size`` x one float32 vector (4 x vocabulary);
* one forward's working set: a batch's padded past with room for the new positions, which the
  model's attention fills in place, in a staging tensor the forward thread keeps between
  forwards (`pool_cache.past_cache`), so one copy of rows x longest prompt x KV per token,
  plus the spare it was allocated with (`STAGING_GROWTH`) and one layer's margin, plus logits
  and log-softmax of every row;
* replies in flight: a worker holds up to two batches at once (one computing, one picked
  ahead or writing its replies), each row's vector as a result tensor, as encoded bytes and in
  the pipeline's send buffer;
* the baseline: the worker's RSS once loaded and idle, which holds the interpreter, torch and
  transformers, the tokenizer and the weights (reported separately).

Sum them and the worker must stay below; the cache instance must stay below its
``maxmemory``; the queue instance below its idle usage plus the replies one client can have
outstanding (unread, read-but-untrimmed, and one in the worker's pipeline, each a vector).
"""

from __future__ import annotations

import argparse
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from lmqueue.shared.connections import sync_redis

from .workload import Workload

__all__ = ["MemorySampler", "model_figures", "derive_bounds", "reset_peak_rss", "vm_hwm"]

#: The worker's default batch size (rows in one forward).
_WORKER_BATCH = 32
#: Batches a worker holds at once (`workers.worker.Worker` prefetch).
_PREFETCH_BATCHES = 2


class MemorySampler:
    """Samples a worker's RSS and the ``used_memory`` of named Redis instances."""

    def __init__(self, worker_pid: int, redis_urls: dict[str, str], every_s: float) -> None:
        self.process = psutil.Process(worker_pid)
        self.redis = {name: sync_redis(url) for name, url in redis_urls.items()}
        self.every_s = every_s
        self.samples: list[dict[str, int]] = []
        self._started = time.monotonic()

    def sample(self) -> dict[str, int]:
        """One reading of every figure, in bytes."""
        values = {"worker_rss": int(self.process.memory_info().rss)}
        for name, client in self.redis.items():
            info: dict[str, Any] = client.info("memory")  # type: ignore[assignment]
            values[f"{name}_used_memory"] = int(info["used_memory"])
        return values

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Sample on a thread for the duration of the block; close the Redis clients after."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                with contextlib.suppress(psutil.Error, OSError, ConnectionError):
                    sample = self.sample()
                    sample["t_ms"] = int((time.monotonic() - self._started) * 1000)
                    self.samples.append(sample)
                stop.wait(self.every_s)

        thread = threading.Thread(target=loop, name="lmq-bench-memory", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            for client in self.redis.values():
                client.close()

    def peaks(self) -> dict[str, int]:
        """The largest sampled value of each figure."""
        keys = [k for k in self.samples[0] if k != "t_ms"] if self.samples else []
        return {key: max(s[key] for s in self.samples) for key in keys}

    def timeline(self, points: int = 120) -> dict[str, list[Any]]:
        """About `points` samples as rows of seconds and MiB, for plots and result files."""
        step = max(1, len(self.samples) // points)
        keys = [k for k in self.samples[0] if k != "t_ms"] if self.samples else []
        rows = [
            [s["t_ms"] / 1000, *(round(s[k] / 2**20, 1) for k in keys)]
            for s in self.samples[::step]
        ]
        return {"columns": ["s", *(f"{k}_mib" for k in keys)], "rows": rows}


def model_figures(model: Any) -> dict[str, Any]:
    """Weight bytes, KV bytes per token position and vector bytes of a loaded causal LM."""
    config = model.config.get_text_config()
    element = next(model.parameters()).element_size()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    tensors = [*model.parameters(), *model.buffers()]
    return {
        "weights_bytes": sum(t.numel() * t.element_size() for t in tensors),
        "kv_bytes_per_token": 2 * config.num_hidden_layers * kv_heads * head_dim * element,
        "vector_bytes": 4 * int(model.get_output_embeddings().weight.shape[0]),
        "layers": config.num_hidden_layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "dtype": str(next(model.parameters()).dtype),
    }


def derive_bounds(
    args: argparse.Namespace,
    model: dict[str, Any],
    baseline: dict[str, int],
    workload: Workload,
    cache_maxmemory: int,
) -> dict[str, int]:
    """The bytes each process may reach, from the configured limits (see the module doc)."""
    from lmqueue.workers.backends.pool_cache import STAGING_GROWTH  # torch: not in clients

    per_token, vector = model["kv_bytes_per_token"], model["vector_bytes"]
    rows = min(workload.particles, _WORKER_BATCH)
    longest = len(workload.prompt) + workload.steps + 1
    kv = args.max_kv_tokens * per_token
    results = args.cache_size * vector
    layers = model["layers"]
    staged = rows * longest * per_token * (1 + STAGING_GROWTH + 1 / layers)
    forward = int(staged) + 3 * rows * vector
    in_flight = _PREFETCH_BATCHES * rows * vector * 3
    outstanding = 3 * workload.particles * vector
    return {
        "worker_baseline": baseline["worker_rss"],
        "worker_kv": kv,
        "worker_results": results,
        "worker_forward": forward,
        "worker_in_flight": in_flight,
        "worker": baseline["worker_rss"] + kv + results + forward + in_flight,
        "cache_redis": cache_maxmemory,
        "queue_baseline": baseline["queue_used_memory"],
        "queue_redis": baseline["queue_used_memory"] + outstanding,
    }


def reset_peak_rss(pid: int) -> bool:
    """Reset the kernel's peak-RSS mark of `pid` (so loading does not count); False if refused."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def vm_hwm(pid: int) -> int | None:
    """The peak RSS of `pid` since its last reset, from ``/proc/<pid>/status`` (None if unread)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
