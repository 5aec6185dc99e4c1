"""The plot of ``lmq bench fairness``: B's percentiles as bars, and B's latencies as a CDF.

The bars compare fair share with FIFO at p50 and p99; the right panel draws the share of B's
calls slower than each latency (a complementary CDF on a log scale), where a held forward is
a shoulder at the bottom right, visible even when it moves p99 little.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .report import save_figure

__all__ = ["plot"]


def plot(results: dict[str, Any], real: dict[str, Any] | None, path: Path, run: int = 1) -> Path:
    """The figure of one mock run (and the real model's first run, if any), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, cdf) = plt.subplots(1, 2, figsize=(12, 4.2), dpi=110)
    _bars(bars, results)
    bars.set_title(f"Mock worker, run {run}: A floods (2,000 in flight), B 16 in flight",
                   fontsize=9)  # fmt: skip
    series = [
        ("mock: B alone", results["fair"]["light_alone_ms"], "C0", "-"),
        ("mock: B under flood (fair share)", results["fair"]["light_under_flood_ms"], "C1", "-"),
    ]
    if real is not None:
        first = real["runs"][0]
        series += [
            ("SmolLM2: B's SMC steps alone", first["light_alone_ms"], "C2", "--"),
            ("SmolLM2: B's SMC steps under flood", first["light_under_flood_ms"], "C3", "--"),
        ]
    for label, values, color, style in series:
        _ccdf(cdf, values, label, color, style)
    cdf.set_xscale("log")
    cdf.set_yscale("log")
    cdf.set_xlabel("latency of B's call (ms)")
    cdf.set_ylabel("share of B's calls slower")
    cdf.axhline(0.01, color="grey", lw=0.6, ls=":")
    cdf.axhline(0.001, color="grey", lw=0.6, ls=":")
    cdf.set_title("B's latency tail (dotted: p99, p99.9)", fontsize=9)
    cdf.legend(fontsize=7)
    cdf.grid(alpha=0.3, which="both")
    return save_figure(fig, path)


def _bars(ax: Any, results: dict[str, Any]) -> None:
    labels = ["B alone", "B under flood"]
    width = 0.2
    for i, (name, label) in enumerate((("fair", "fair share"), ("fifo", "FIFO (one stream)"))):
        figures = results[name]
        for j, q in enumerate(("p50_s", "p99_s")):
            values = [figures["light_alone"][q] * 1000, figures["light_under_flood"][q] * 1000]
            xs = [x + (2 * i + j - 1.5) * width for x in range(len(labels))]
            drawn = ax.bar(xs, values, width, label=f"{label} {q[:3]}")
            ax.bar_label(drawn, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("latency of tenant B's calls (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")


def _ccdf(ax: Any, values: list[float], label: str, color: str, style: str) -> None:
    ordered = sorted(values)
    n = len(ordered)
    if not n:
        return
    slower = [(n - i - 1) / n for i in range(n)]
    # the last point (nothing slower) cannot sit on a log axis: end the line at 1/n
    ax.step(ordered[:-1] or ordered, slower[:-1] or [1 / n], where="post", color=color,
            ls=style, label=f"{label} (n={n})")  # fmt: skip
