"""`ShapeSplit`: whether a batch runs sooner as two padded forwards than as one, learned from
the backend's own forwards.

A padded forward (`batch_inputs`) computes every row as wide as the batch's widest run of new
tokens. A batch that mixes rows decoding one token after a stored past (an SMC sampler's
step) with rows prefilling fresh prompts computes each decode row as wide as the prompts: a
flood's 16 eight-token prompts beside a sampler's 16 one-token rows is a forward of 256 token
slots for 144 real tokens, and the sampler waits for all of it every step (BENCHMARKS.md,
fairness, real model). Run as two forwards, the decode rows cost their own slots plus one
more forward's fixed cost. The wide rows go first: the decode rows end the batch, so their
callers' next calls come back while the backend waits for them (`anticipation`), not while it
computes the prompts on the cores those callers share (the other order answered a sampler
sooner but its next step, computed beside the prompts' forward on a 2-core CPU, often missed
the next batch: BENCHMARKS.md, fairness).

Whether that pays depends on the device: on a CPU a forward's time follows its token slots;
on a GPU its fixed cost (launches, a CUDA graph's replay) dwarfs a few hundred slots, and one
forward is faster. So nothing is assumed: a running least-squares fit of the seconds of the
backend's eager forwards against their token slots (rows x widest new run) gives a fixed cost
per forward and a cost per slot, and a batch is split only where the fit says two forwards take
less than `GAIN` of one. Until the forwards seen so far differ enough in size to fit a line
(`MIN_FORWARDS`, `MIN_SPREAD`), batches stay whole.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from .batch_inputs import Row

__all__ = ["GAIN", "MIN_FORWARDS", "MIN_SPREAD", "ShapeSplit", "token_slots"]

#: A batch is split when two forwards are expected to take less than this share of one.
GAIN = 0.8
#: Forwards observed before the fit is trusted ...
MIN_FORWARDS = 8
#: ... and how much their token slots must spread (standard deviation over mean).
MIN_SPREAD = 0.2
#: Weight an observation keeps per later one (an exponential window of ~100 forwards).
_DECAY = 0.99


def token_slots(rows: Sequence[Row]) -> int:
    """What a padded forward of `rows` computes: rows x the widest run of new tokens."""
    return len(rows) * max((len(row.new_tokens) for row in rows), default=0)


class ShapeSplit:
    """The fit of forward seconds against token slots, and the split it advises.

    `observe` is called on forward threads, `groups` on the event loop: a lock keeps the sums
    consistent between them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = 0
        # exponentially weighted sums: weight, x, y, x*x, x*y (x: slots, y: seconds)
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, slots: int, seconds: float) -> None:
        """An eager forward of `slots` token slots took `seconds`."""
        with self._lock:
            self._n += 1
            self._w = _DECAY * self._w + 1.0
            self._x = _DECAY * self._x + slots
            self._y = _DECAY * self._y + seconds
            self._xx = _DECAY * self._xx + slots * slots
            self._xy = _DECAY * self._xy + slots * seconds

    def costs(self) -> tuple[float, float] | None:
        """(fixed seconds a forward, seconds a token slot), or None while the fit is not
        trusted (too few forwards, or all of about one size)."""
        with self._lock:
            n, w, x, y, xx, xy = self._n, self._w, self._x, self._y, self._xx, self._xy
        if n < MIN_FORWARDS or x <= 0:
            return None
        mean = x / w
        variance = xx / w - mean * mean
        if variance <= (MIN_SPREAD * mean) ** 2:
            return None
        per_slot = (xy / w - mean * y / w) / variance
        fixed = y / w - per_slot * mean
        return max(fixed, 0.0), max(per_slot, 0.0)

    def groups(self, rows: Sequence[Row]) -> list[list[int]]:
        """Indexes of `rows` in the forwards to run, in order: all of them in one, or the
        wider rows first and the narrower after, where the fit says that is faster."""
        whole = [list(range(len(rows)))]
        costs = self.costs() if len(rows) > 1 else None
        if costs is None:
            return whole
        fixed, per_slot = costs
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].new_tokens))
        widths = [len(rows[i].new_tokens) for i in order]
        widest = widths[-1]
        best, best_s = 0, fixed + per_slot * len(rows) * widest
        one_s = best_s
        for k in range(1, len(rows)):
            if widths[k - 1] == widest:
                break  # the rest are as wide: splitting there saves no slot
            split_s = 2 * fixed + per_slot * (k * widths[k - 1] + (len(rows) - k) * widest)
            if split_s < best_s:
                best, best_s = k, split_s
        if best == 0 or best_s >= GAIN * one_s:
            return whole
        return [sorted(order[best:]), sorted(order[:best])]  # the wide rows first
