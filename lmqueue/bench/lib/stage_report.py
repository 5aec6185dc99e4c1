"""Reads stage marks (`shared.stage_trace`) back: one tenant's round trip, stage by stage.

For each forward that held calls of `tenant` (a closed loop, such as the fairness benchmark's
light tenant B), the milliseconds from the forward's end to each stage after it, in order:
its replies handed to the writer thread, their commands made there (16-bit payloads
converted: ``writer_cmds``), the first pipeline sent (a separate cache instance's entries come
first: ``writer_sent``), and written, its client reading them and sending its next
calls, the worker reading them all back, the next pick, the next forward. The last is the
backend's idle that the tenant's round trip cost. Beside it, every gap between forwards.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from .load import percentile

__all__ = [
    "Mark", "ROUND_TRIP_STAGES", "read_marks", "round_trips", "idle_gaps", "report_lines",
    "spread_of",
]  # fmt: skip

#: (seconds, stage, details) of one line.
Mark = tuple[float, str, str]

#: The stages of a round trip, in the order they happen (``client.`` ones: the tenant's client).
ROUND_TRIP_STAGES = (
    "write_start", "writer_start", "writer_cmds", "writer_sent", "writer_done", "written",
    "client.replies", "client.settled", "client.submit", "client.submitted", "read", "pick",
    "forward_start",
)  # fmt: skip


def read_marks(path: Path) -> list[Mark]:
    """The marks of one process's file, in time order."""
    marks = []
    for line in path.read_text().splitlines():
        seconds, stage, details = (line.split(" ", 2) + ["", ""])[:3]
        marks.append((float(seconds), stage, details))
    return sorted(marks)


def _counts(details: str) -> dict[str, int]:
    """``tenant:n,...`` as a dict."""
    pairs = (item.rsplit(":", 1) for item in details.split(",") if ":" in item)
    return {tenant: int(n) for tenant, n in pairs}


def round_trips(
    worker: Iterable[Mark], client: Iterable[Mark], tenant: str, start: float, end: float
) -> dict[str, list[float]]:
    """Milliseconds from the end of each forward holding `tenant`'s calls (ending in [start,
    end)) to the first time each stage of `ROUND_TRIP_STAGES` was reached after it."""
    marks = sorted([*worker, *((t, f"client.{s}", d) for t, s, d in client)])
    found: dict[str, list[float]] = {stage: [] for stage in ROUND_TRIP_STAGES}
    picked = 0  # the tenant's calls in the batch picked last
    for index, (at, stage, details) in enumerate(marks):
        if stage == "pick":
            picked = _counts(details).get(tenant, 0)
        elif stage == "forward_end" and picked and start <= at < end:
            for name, offset in _stages_after(marks[index + 1 :], tenant, picked):
                found[name].append((offset - at) * 1000)
    return found


def _stages_after(marks: list[Mark], tenant: str, calls: int) -> list[tuple[str, float]]:
    """The first time of each round-trip stage in `marks` (up to the next forward)."""
    seen: dict[str, float] = {}
    writing = False  # between the tenant's write_start and written
    for at, stage, details in marks:
        if stage in ("write_start", "written") and details != tenant:
            continue
        if stage == "write_start":
            writing = True
        elif stage == "written":
            writing = False
        elif stage.startswith("writer_") and not writing:
            continue
        elif stage == "read" and _counts(details).get(tenant, 0) < calls:
            continue
        if stage in ROUND_TRIP_STAGES:
            seen.setdefault(stage, at)
        if stage == "forward_start":
            break
    return list(seen.items())


def idle_gaps(worker: Iterable[Mark], start: float, end: float) -> list[float]:
    """Milliseconds from each forward's end (in [start, end)) to the next forward's start."""
    gaps, ended = [], None
    for at, stage, _ in worker:
        if stage == "forward_end":
            ended = at if start <= at < end else None
        elif stage == "forward_start" and ended is not None:
            gaps.append((at - ended) * 1000)
            ended = None
    return gaps


def report_lines(stages: dict[str, list[float]], gaps: list[float], tenant: str) -> list[str]:
    """A table of p10 / p50 / p90 milliseconds per stage, and of the idle between forwards."""
    lines = [f"{tenant}'s round trip after a forward holding its calls (ms: p10 / p50 / p90, n):"]
    for stage in ROUND_TRIP_STAGES:
        values = stages.get(stage, [])
        lines.append(f"  {stage:<18} {_quantiles(values)}")
    lines.append(f"  idle between any two forwards: {_quantiles(gaps)}")
    return lines


def spread_of(values: list[float]) -> dict[str, float]:
    """p10, p50 and p90 of `values` (ms) and their count, for a report's JSON."""
    if not values:
        return {"n": 0}
    return {"n": len(values), **{f"p{q}": round(percentile(values, q), 3) for q in (10, 50, 90)}}


def _quantiles(values: list[float]) -> str:
    figures = spread_of(values)
    if not figures["n"]:
        return "-"
    return (
        f"{figures['p10']:6.2f} / {figures['p50']:6.2f} / {figures['p90']:6.2f} (n={figures['n']})"
    )
