"""Is a memory series flat after its warm-up? The soak's leak test.

Each series (a worker's RSS, Redis ``used_memory``, a stream's length, a count of keys) is a
list of (seconds since start, value) samples. The first third of the run is warm-up: caches
fill, adapters load, the allocator settles. Over the rest:

* the slope is the Theil-Sen estimate (the median of the slopes between sample pairs), which
  the faults' step changes (a restarted worker's RSS starts low, a restarted Redis reloads its
  AOF) move far less than they move a least-squares line;
* the *rise* is that slope times the length of the window: what the series gained over it;
* the series is flat when the rise is at most ``max(rel x level, floor)``, where the level is
  the window's median and the floor is the series kind's noise (a few MiB of allocator
  churn, a few dozen stream entries in flight).

So on a 60-minute run a worker RSS series of ~300 MiB fails once it grows by more than 15 MiB
over the last 40 minutes. The rise is also reported per hour, for comparing runs of
different lengths.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Flatness", "flatness", "theil_sen_slope", "REL_TOLERANCE"]

#: Allowed rise over the window, as a share of the series' median level there.
REL_TOLERANCE = 0.05
#: At most this many points enter the pairwise slopes (evenly spaced): O(n^2) pairs.
_MAX_POINTS = 400


@dataclass(frozen=True)
class Flatness:
    """The verdict on one series."""

    name: str
    samples: int
    level: float
    slope_per_h: float
    rise: float
    allowed: float
    flat: bool

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able copy."""
        return asdict(self)

    def line(self) -> str:
        """One printable line."""
        verdict = "flat" if self.flat else "RISING"
        return (
            f"{self.name:<34} {verdict:<7} level {self.level:12.1f}  rise {self.rise:+11.1f} "
            f"(allowed {self.allowed:.1f})  {self.slope_per_h:+.1f}/h"
        )


def theil_sen_slope(points: Sequence[tuple[float, float]]) -> float:
    """The median slope over all pairs of points with different times (0.0 if none)."""
    if len(points) > _MAX_POINTS:
        step = len(points) / _MAX_POINTS
        points = [points[int(i * step)] for i in range(_MAX_POINTS)]
    slopes = [
        (y2 - y1) / (x2 - x1)
        for i, (x1, y1) in enumerate(points)
        for x2, y2 in points[i + 1 :]
        if x2 != x1
    ]
    return statistics.median(slopes) if slopes else 0.0


def flatness(
    name: str,
    points: Sequence[tuple[float, float]],
    floor: float,
    warmup_share: float = 1 / 3,
    rel: float = REL_TOLERANCE,
) -> Flatness:
    """Judge the series after its first `warmup_share` of time (see the module docstring)."""
    if not points:
        return Flatness(name, 0, 0.0, 0.0, 0.0, floor, True)
    start, end = points[0][0], points[-1][0]
    cut = start + (end - start) * warmup_share
    window = [(t, v) for t, v in points if t >= cut]
    if len(window) < 3:
        return Flatness(name, len(window), 0.0, 0.0, 0.0, floor, True)
    slope = theil_sen_slope(window)
    span = window[-1][0] - window[0][0]
    level = statistics.median(v for _, v in window)
    rise = slope * span
    allowed = max(rel * abs(level), floor)
    return Flatness(name, len(window), level, slope * 3600, rise, allowed, rise <= allowed)
