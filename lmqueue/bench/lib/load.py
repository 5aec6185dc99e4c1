"""Closed-loop load and the measurement window every throughput benchmark shares.

A closed loop keeps a fixed number of calls outstanding (each of `concurrency` tasks awaits one
call after another), which is how many concurrent sampling programs load a model. Throughput is
counted in a window after a warm-up: start-up (connections, first batches, the worker's first
allocations) is not what a long-running deployment sees.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .report import Report
from .stack import CpuMeter

__all__ = [
    "WIRE_BYTES",
    "Counter",
    "Window",
    "add_load_arguments",
    "closed_loop",
    "distinct_prompt",
    "measure_distinct_calls",
    "measure_window",
    "percentile",
    "record_window",
    "wire_dtypes",
]

#: Bytes per value of each wire dtype.
WIRE_BYTES = {"float32": 4, "float16": 2}


@dataclass
class Counter:
    """Completion times of calls so far (`time.perf_counter` seconds)."""

    times: list[float] = field(default_factory=list)

    def tick(self, count: int = 1) -> None:
        """Record `count` completions now."""
        now = time.perf_counter()
        self.times.extend([now] * count)


@dataclass
class Window:
    """What one measurement window saw."""

    replies: int
    elapsed_s: float
    cpu_s: dict[str, float] = field(default_factory=dict)
    times: list[float] = field(default_factory=list, repr=False)
    #: The system (kernel) part of `cpu_s`, where the meter read it.
    system_s: dict[str, float] = field(default_factory=dict)

    @property
    def per_s(self) -> float:
        """Replies counted in the window, per second of the window."""
        return self.replies / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def fitted_per_s(self) -> float:
        """Replies per second as the least-squares slope of completions against time.

        When replies come in bursts, one batch at a time (a worker with a fixed time per
        batch), counting them in a fixed window is off by up to one batch (4% of a 25-batch
        window); a slope through every completion is not. With few completions, `per_s`.
        """
        if len(self.times) < 3 or self.times[-1] - self.times[0] < self.elapsed_s / 4:
            return self.per_s
        return float(np.polyfit(np.asarray(self.times), np.arange(len(self.times)), 1)[0])

    def cpu_us_per_reply(self) -> dict[str, float]:
        """CPU microseconds each process group spent per reply."""
        return self._per_reply(self.cpu_s)

    def kernel_us_per_reply(self) -> dict[str, float]:
        """The kernel's part of `cpu_us_per_reply` (empty where the meter did not read it)."""
        return self._per_reply(self.system_s)

    def _per_reply(self, seconds: dict[str, float]) -> dict[str, float]:
        if not self.replies:
            return {name: math.nan for name in seconds}
        return {name: round(s * 1e6 / self.replies, 1) for name, s in seconds.items()}

    def as_dict(self) -> dict[str, object]:
        """The window's figures for a result file."""
        figures: dict[str, object] = {
            "replies": self.replies,
            "elapsed_s": round(self.elapsed_s, 3),
            "replies_per_s": round(self.per_s, 1),
            "replies_per_s_fitted": round(self.fitted_per_s, 1),
            "cpu_s": {name: round(s, 3) for name, s in self.cpu_s.items()},
            "cpu_us_per_reply": self.cpu_us_per_reply(),
        }
        if self.system_s:
            figures["kernel_us_per_reply"] = self.kernel_us_per_reply()
        return figures


def distinct_prompt(index: int, salt: int, length: int = 8) -> list[int]:
    """A short prompt unique to (`index`, `salt`) for a billion indexes; ids at most 32,768.

    Distinct prompts keep every layer of deduplication and caching out of a transport figure.
    """
    head = [1 + salt % 30_000, 1 + (index >> 15) % 30_000, 1 + (index & 0x7FFF)]
    return head + [7] * (length - 3)


async def measure_window(
    counter: Counter, warmup_s: float, measure_s: float, meter: CpuMeter | None = None
) -> Window:
    """Let load run `warmup_s`, then count completions and CPU for `measure_s`."""
    await asyncio.sleep(warmup_s)
    if meter is not None:
        meter.start()
    first, started = len(counter.times), time.perf_counter()
    await asyncio.sleep(measure_s)
    last, elapsed = len(counter.times), time.perf_counter() - started
    cpu = meter.stop() if meter is not None else {}
    system = meter.system_s if meter is not None else {}
    return Window(last - first, elapsed, cpu, counter.times[first:last], system)


async def closed_loop(
    call: Callable[[int], Awaitable[object]],
    concurrency: int,
    warmup_s: float,
    measure_s: float,
    meter: CpuMeter | None = None,
) -> Window:
    """Keep `concurrency` calls of ``call(index)`` outstanding; measure one window.

    Each call gets a fresh index. After the window the loop stops issuing calls and waits for
    the outstanding ones, so nothing is left pending in the client.
    """
    counter = Counter()
    indexes = iter(range(1 << 62))
    stopping = False

    async def loop() -> None:
        while not stopping:
            await call(next(indexes))
            counter.tick()

    tasks = [asyncio.create_task(loop()) for _ in range(concurrency)]
    try:
        window = await measure_window(counter, warmup_s, measure_s, meter)
        stopping = True
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return window


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0-100) of `values`, nearest-rank on sorted data."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a closed-loop load of mock vectors (``transport``'s and ``cluster``'s)."""
    parser.add_argument("--model", default="smollm2-135m", help="whose vocabulary sizes vectors")
    parser.add_argument("--dtypes", default="float32,float16", help="wire dtypes, comma-separated")
    parser.add_argument("--concurrency", type=int, default=512, help="calls kept outstanding")
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--measure-s", type=float, default=6.0)
    parser.add_argument("--distinct-vectors", type=int, default=64)


def wire_dtypes(args: argparse.Namespace) -> list[str]:
    """The wire dtypes of ``--dtypes``, in order."""
    return [d.strip() for d in args.dtypes.split(",") if d.strip()]


def record_window(
    report: Report, key: str, window: Window, payload_bytes: int
) -> tuple[float, float]:
    """Print and keep a window's figures; its replies/s and total CPU us per reply."""
    cpu, kernel = window.cpu_us_per_reply(), window.kernel_us_per_reply()
    gbps = window.per_s * payload_bytes / 1e9
    line = (f"{key:<18} {window.per_s:8.1f} replies/s  {gbps:5.2f} GB/s  CPU us/reply: "
            + ", ".join(f"{name} {us:.0f}" + (f" (kernel {kernel[name]:.0f})" if name in kernel
                        else "") for name, us in cpu.items()))  # fmt: skip
    report.figure(key, {**window.as_dict(), "payload_gb_per_s": round(gbps, 3)}, line=line)
    return window.per_s, sum(cpu.values())


async def measure_distinct_calls(
    lm: Any, salt: int, args: argparse.Namespace, meter: CpuMeter
) -> Window:
    """``--concurrency`` calls of `lm` kept outstanding, each on a prompt of its own, measured
    for ``--measure-s`` after ``--warmup-s``."""

    async def call(index: int) -> None:
        await lm.next_token_logprobs(distinct_prompt(index, salt))

    return await closed_loop(call, args.concurrency, args.warmup_s, args.measure_s, meter)
