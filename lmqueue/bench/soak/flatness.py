"""Is a memory series flat after its warm-up? The soak's leak test.

Each series (a worker's RSS, Redis ``used_memory``, a stream's length, a count of keys) is a
list of (seconds since start, value) samples. The first third of the run is warm-up: caches
fill, adapters load, the allocator settles. Over the rest:

* the slope is the Theil-Sen estimate (the median of the slopes between sample pairs), which
  the faults' step changes (a restarted worker's RSS starts low, a restarted Redis reloads its
  AOF) move far less than they move a least-squares line;
* a process's own series (its RSS, its GPU memory) is judged life by life: a restart starts a
  new life (`Monitor.restarts`), and only pairs of samples of one life enter the slopes. A
  leak is growth within a process's life; a restarted process may settle at another level
  (its heap laid out anew: a soak's client came back 46 MiB higher and stayed there), and
  that step, near the middle of the window, made the median of all pairs' slopes positive;
* the *rise* is that slope times the length of the window: what the series gained over it;
* the series is flat when the rise is at most ``max(rel x level, floor)``, where the level is
  the window's median and the floor is the series kind's noise (a few MiB of allocator
  churn, a few dozen stream entries in flight).

So on a 60-minute run a worker RSS series of ~300 MiB fails once it grows by more than 15 MiB
over the last 40 minutes. The rise is also reported per hour, for comparing runs of
different lengths.
"""

from __future__ import annotations

import bisect
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
    #: The process lives the window spans (restarts + 1; 1 for a series of no process).
    lives: int = 1

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able copy."""
        return asdict(self)

    def line(self) -> str:
        """One printable line."""
        verdict = "flat" if self.flat else "RISING"
        lives = f"  ({self.lives} lives)" if self.lives > 1 else ""
        return (
            f"{self.name:<34} {verdict:<7} level {self.level:12.1f}  rise {self.rise:+11.1f} "
            f"(allowed {self.allowed:.1f})  {self.slope_per_h:+.1f}/h{lives}"
        )


def theil_sen_slope(points: Sequence[tuple[float, float]], breaks: Sequence[float] = ()) -> float:
    """The median slope over all pairs of points with different times (0.0 if none); with
    `breaks` (the times a new life began), only over pairs within one life."""
    if len(points) > _MAX_POINTS:
        step = len(points) / _MAX_POINTS
        points = [points[int(i * step)] for i in range(_MAX_POINTS)]
    life = _lives(points, breaks)
    slopes = []
    for i, (x1, y1) in enumerate(points):
        for j in range(i + 1, len(points)):
            x2, y2 = points[j]
            if x2 != x1 and life[j] == life[i]:
                slopes.append((y2 - y1) / (x2 - x1))
    return statistics.median(slopes) if slopes else 0.0


def _lives(points: Sequence[tuple[float, float]], breaks: Sequence[float]) -> list[int]:
    """Each point's life: how many breaks came at or before it."""
    cuts = sorted(breaks)
    return [bisect.bisect_right(cuts, t) for t, _ in points]


def flatness(
    name: str,
    points: Sequence[tuple[float, float]],
    floor: float,
    warmup_share: float = 1 / 3,
    rel: float = REL_TOLERANCE,
    breaks: Sequence[float] = (),
) -> Flatness:
    """Judge the series after its first `warmup_share` of time, life by life where `breaks`
    says when a restarted process began a new one (see the module docstring)."""
    if not points:
        return Flatness(name, 0, 0.0, 0.0, 0.0, floor, True)
    start, end = points[0][0], points[-1][0]
    cut = start + (end - start) * warmup_share
    window = [(t, v) for t, v in points if t >= cut]
    if len(window) < 3:
        return Flatness(name, len(window), 0.0, 0.0, 0.0, floor, True)
    slope = theil_sen_slope(window, breaks)
    span = window[-1][0] - window[0][0]
    level = statistics.median(v for _, v in window)
    rise = slope * span
    allowed = max(rel * abs(level), floor)
    lives = len(set(_lives(window, breaks)))
    return Flatness(name, len(window), level, slope * 3600, rise, allowed, rise <= allowed, lives)
