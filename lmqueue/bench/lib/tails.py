"""Tails and spreads: what a benchmark prints so that a slow tail or a lucky run is visible.

* `latency_figures`: a set of latencies as p50, p99, p99.9, max and a histogram, so one held
  forward shows up as a bump at the right of the histogram, not only as a larger p99;
* `spread`: the figures of N runs of one benchmark, each printed, with the worst and the
  median beside each other (a figure is the worst of several runs, never the best);
* `GcPauses`: the garbage collector's pauses in this process, so a tail caused by the
  benchmark's own process (it hosts the clients) is told apart from one the worker causes.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

from .load import percentile

__all__ = [
    "latency_figures",
    "histogram_line",
    "spread",
    "spread_lines",
    "load_avg",
    "GcPauses",
]

#: Histogram buckets, in ms: the upper edge of each (the last catches the rest).
BUCKETS_MS = (50, 100, 150, 200, 250, 300, 400, 500, 750, 1000, 2000, 5000)


def latency_figures(values: Sequence[float]) -> dict[str, Any]:
    """Calls, p50/p99/p99.9/max (seconds) and the histogram (calls per bucket) of `values`."""
    counts = [0] * (len(BUCKETS_MS) + 1)
    for value in values:
        ms = value * 1000
        index = next((i for i, edge in enumerate(BUCKETS_MS) if ms <= edge), len(BUCKETS_MS))
        counts[index] += 1
    return {
        "calls": len(values),
        "p50_s": round(percentile(values, 50), 4),
        "p99_s": round(percentile(values, 99), 4),
        "p999_s": round(percentile(values, 99.9), 4),
        "max_s": round(max(values), 4) if values else float("nan"),
        "histogram_ms": {"edges": list(BUCKETS_MS), "counts": counts},
    }


def histogram_line(figures: Mapping[str, Any]) -> str:
    """The histogram as one line: ``<=100 ms: 700 | <=150: 60 | ...`` (empty buckets left out)."""
    edges, counts = figures["histogram_ms"]["edges"], figures["histogram_ms"]["counts"]
    labels = [f"<={edge}" for edge in edges] + [f">{edges[-1]}"]
    return " | ".join(f"{label}: {n}" for label, n in zip(labels, counts, strict=True) if n)


def spread(runs: Sequence[Mapping[str, float]], higher_is_worse: Mapping[str, bool]) -> dict:
    """Worst and median of each figure over `runs` (worst: the max where higher is worse)."""
    summary: dict[str, dict[str, float]] = {}
    for key, worse_high in higher_is_worse.items():
        values = [run[key] for run in runs if key in run]
        if values:
            summary[key] = {
                "worst": max(values) if worse_high else min(values),
                "median": round(statistics.median(values), 4),
                "best": min(values) if worse_high else max(values),
            }
    return summary


def spread_lines(runs: Sequence[Mapping[str, Any]], summary: Mapping[str, Any]) -> list[str]:
    """One line a run (its figures and load average), then worst / median of each figure."""
    lines = []
    for i, run in enumerate(runs, 1):
        figures = ", ".join(f"{k} {run[k]}" for k in summary)
        lines.append(f"run {i}: {figures} (load average {run.get('load_avg', '?')})")
    for key, values in summary.items():
        lines.append(f"{key}: worst {values['worst']}, median {values['median']} "
                     f"over {len(runs)} runs")  # fmt: skip
    return lines


def load_avg() -> str:
    """The 1-, 5- and 15-minute load averages, as `uptime` prints them."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


class GcPauses:
    """Records this process's garbage-collection pauses longer than `min_ms` while installed."""

    def __init__(self, min_ms: float = 10.0) -> None:
        self.min_ms = min_ms
        self.pauses: list[tuple[float, int, float]] = []  # (ended at perf_counter, gen, ms)
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        now = time.perf_counter()
        ms = (now - self._started) * 1000
        if ms >= self.min_ms:
            self.pauses.append((now, int(info["generation"]), round(ms, 1)))

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def between(self, start: float, end: float) -> list[dict[str, float]]:
        """The pauses that ended in [start, end) (perf_counter times)."""
        return [{"generation": g, "ms": ms} for at, g, ms in self.pauses if start <= at < end]
