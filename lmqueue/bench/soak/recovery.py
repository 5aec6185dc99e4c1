"""Throughput over the soak, and how long it took to come back after each fault.

Answered calls are counted in buckets of `BUCKET_S` seconds. A fault's *level* is the median
rate of the buckets in the `BEFORE_S` seconds before it; it has *recovered* at the end of the
first bucket that ends after its repair and runs at `RECOVERED_SHARE` of that level or more.
The recovery time counts from the fault's start; a fault after which the rate never came back
before the next one began (or the run ended) has none (reported as not recovered).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

__all__ = ["rates", "recoveries", "by_kind", "BUCKET_S", "RECOVERED_SHARE"]

BUCKET_S = 5.0
BEFORE_S = 30.0
RECOVERED_SHARE = 0.8


def rates(
    points: Sequence[tuple[float, int]], start: float, end: float
) -> list[tuple[float, float]]:
    """(bucket start in seconds since `start`, calls answered per second in it) over the run."""
    buckets = max(int((end - start) // BUCKET_S), 0)
    counts = [0] * buckets
    for t, n in points:
        i = int((t - start) // BUCKET_S)
        if 0 <= i < buckets:
            counts[i] += n
    return [(i * BUCKET_S, c / BUCKET_S) for i, c in enumerate(counts)]


def recoveries(
    series: Sequence[tuple[float, float]], faults: Sequence[dict[str, Any]], start: float
) -> list[dict[str, Any]]:
    """Each fault (``kind``, ``at`` wall time, ``repair_s``) with its level and recovery time."""
    out = []
    starts = [f["at"] - start for f in faults]
    for index, fault in enumerate(faults):
        at = starts[index]
        until = starts[index + 1] if index + 1 < len(faults) else float("inf")
        before = [r for t, r in series if at - BEFORE_S <= t and t + BUCKET_S <= at]
        level = statistics.median(before) if before else 0.0
        recovered_s = None
        for t, rate in series:
            end = t + BUCKET_S
            if end <= at + fault["repair_s"] or t < at:
                continue
            if t >= until:
                break
            if rate >= RECOVERED_SHARE * level:
                recovered_s = round(end - at, 1)
                break
        out.append({**fault, "level": round(level, 1), "recovered_s": recovered_s})
    return out


def by_kind(recovered: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per fault kind: how many, how many recovered, and the worst and median recovery."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for fault in recovered:
        groups[fault["kind"]].append(fault)
    summary = {}
    for kind, faults in groups.items():
        times = [f["recovered_s"] for f in faults if f["recovered_s"] is not None]
        summary[kind] = {
            "faults": len(faults),
            "recovered": len(times),
            "worst_s": max(times) if times else None,
            "median_s": statistics.median(times) if times else None,
            "worst_repair_s": max(f["repair_s"] for f in faults),
        }
    return summary
