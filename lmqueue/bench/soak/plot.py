"""The plot of ``lmq bench soak``: throughput and memory over the run, faults marked.

Four panels sharing the time axis: calls answered per second (5-s buckets); each process's
RSS; Redis memory (the queue's ``used_memory`` and the cache's); the stream and key counts.
Each fault is a vertical line coloured by kind, and the warm-up third is shaded, so a series
that climbs after it (a leak) and a rate that does not come back (a stuck stream) stand out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..lib.report import save_figure

__all__ = ["plot"]

_FAULT_COLOURS = {
    "kill_worker": "C3", "restart_redis": "C1", "kill_master": "C1", "restart_client": "C2",
    "stop_worker": "C4",
}  # fmt: skip
_COUNTS = ("request_entries", "pending_entries", "reply_streams", "reply_entries",
           "scheduler_keys", "experiment_keys", "queue_keys", "claim_check_keys")  # fmt: skip


def plot(
    rates: Sequence[tuple[float, float]],
    series: Mapping[str, Sequence[tuple[float, float]]],
    faults: Sequence[dict[str, Any]],
    start: float,
    path: Path,
    title: str,
) -> Path:
    """Draw the run to `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(12, 11), dpi=100, sharex=True)
    minutes = [t / 60 for t, _ in rates]
    axes[0].plot(minutes, [r for _, r in rates], lw=0.8, color="k")
    axes[0].set_ylabel("calls answered / s")
    axes[0].set_title(title, fontsize=10)
    _lines(axes[1], series, lambda n: n.startswith(("rss_mib:", "gpu_mib:")))
    axes[1].set_ylabel("RSS (MiB)")
    _lines(axes[2], series, lambda n: n in ("queue_used_mib", "cache_used_mib"))
    axes[2].set_ylabel("Redis used_memory (MiB)")
    _lines(axes[3], series, lambda n: n in _COUNTS)
    axes[3].set_ylabel("entries / keys")
    axes[3].set_yscale("symlog")
    axes[3].set_xlabel("minutes")
    end = max([t for t, _ in rates] + [0.0]) / 60
    seen: set[str] = set()
    for ax in axes:
        ax.axvspan(0, end / 3, color="grey", alpha=0.08)
        ax.grid(alpha=0.3)
        for fault in faults:
            kind = fault["kind"]
            label = kind if ax is axes[0] and kind not in seen else None
            if label:
                seen.add(kind)
            ax.axvline((fault["at"] - start) / 60, color=_FAULT_COLOURS.get(kind, "grey"),
                       lw=0.7, ls="--", label=label)  # fmt: skip
        ax.legend(fontsize=6, loc="upper left", ncol=4)
    return save_figure(fig, path)


def _lines(ax: Any, series: Mapping[str, Sequence[tuple[float, float]]], pick: Any) -> None:
    for name, points in sorted(series.items()):
        if pick(name) and points:
            ax.plot([t / 60 for t, _ in points], [v for _, v in points], lw=0.8, label=name)
