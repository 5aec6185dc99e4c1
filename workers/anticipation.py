"""Anticipation: before picking the next batch, wait a moment for a returning tenant's calls.

A closed-loop tenant (an SMC sampler: each step's calls go out when the last step's replies
arrive) whose calls were in the forward now ending has nothing queued when late binding picks
the next batch (`late_binding`: a fifth of a forward before its end). Its next calls arrive a
few milliseconds after its replies, when the next forward, full of other tenants' rows, has
started: they wait for all of it and then run in the one after, two full forwards. On the
fairness benchmark that was 197 ms against 68 ms for the same tenant alone, every call, a p99
ratio of 2.9 (BENCHMARKS.md 3b). An idle worker already waits `max_wait_ms` for a batch to
fill; a busy one now waits for a *returning* tenant, up to `anticipate_ms`: while a tenant
that had calls in a batch sent to the backend has fewer queued than it had there, the next
batch is not picked until that tenant's replies are written and then either as many calls of
it are queued again, or `anticipate_ms` has passed since its replies (anticipatory
scheduling, as disk schedulers wait for a process's next read rather than seek away).

While a returning tenant is awaited it also keeps its place in the fair share
(`FairShare.add`'s credit, one batch's worth at most): idle only between its replies and its
next calls, it would otherwise be lifted to the others' level every round and get less than
its share though it asks for no more.

The cost is bounded: the backend idles at most `anticipate_ms` (plus the reply's writing) per
forward, and only while such a tenant exists. A tenant with a backlog is never waited for; one
whose wait ran out twice in a row (it stopped, thinks longer, or another worker reads its
calls) is not waited for during its next `COOL_OFF_BATCHES` batches, then tried again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["COOL_OFF_BATCHES", "ReturningTenants"]

#: Waits that ran out in a row before a tenant is not waited for a while ...
MISSES_BEFORE_COOL_OFF = 2
#: ... and for how many of its batches.
COOL_OFF_BATCHES = 16


@dataclass(slots=True)
class _Expected:
    calls: int  # how many of its calls the batch sent to the backend held
    cost: float  # what they were charged (fair-share cost units)
    replied_at: float | None = None  # when their replies were written


class ReturningTenants:
    """Tenants whose next calls the next batch should wait for, and for how long.

    Args:
        wait_s: how long after a tenant's replies are written its next calls are waited for
            (the worker's ``anticipate_ms``; 0 waits for none).
        clock: monotonic seconds (a test's fake clock).
    """

    def __init__(self, wait_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.wait_s = wait_s
        self.clock = clock
        self._expected: dict[str, _Expected] = {}
        self._misses: dict[str, int] = {}  # waits run out in a row, by tenant
        self._cooling: dict[str, int] = {}  # batches of the tenant not to wait after

    def sent(self, tenant: str, calls: int, cost: float) -> None:
        """A batch holding `calls` of `tenant`'s requests, charged `cost`, went to the backend."""
        if self._cooling.get(tenant):
            self._cooling[tenant] -= 1
            self._expected.pop(tenant, None)
        elif self.wait_s > 0 and calls > 0:
            self._expected[tenant] = _Expected(calls, cost)

    def credit(self, tenant: str) -> float:
        """The fair-share credit a returning tenant keeps (`FairShare.add`): what its calls in
        the last batch cost, while they are awaited; 0 for any other tenant."""
        expected = self._expected.get(tenant)
        return expected.cost if expected is not None else 0.0

    def replied(self, tenant: str) -> None:
        """The replies of `tenant`'s part of a batch are written: its next calls may come."""
        expected = self._expected.get(tenant)
        if expected is not None and expected.replied_at is None:
            expected.replied_at = self.clock()

    def waiting(self, backlog: Callable[[str], int]) -> tuple[bool, float | None]:
        """Whether to hold the next pick, and at most how long (None: until a reply is written).

        `backlog(tenant)` is how many of the tenant's requests are queued for picking; a
        tenant with as many as it had in its batch, or whose wait is over, is forgotten.
        """
        now = self.clock()
        longest: float | None = 0.0
        for tenant, expected in list(self._expected.items()):
            if backlog(tenant) >= expected.calls:
                del self._expected[tenant]
                self._misses.pop(tenant, None)
            elif expected.replied_at is None:
                longest = None
            elif (left_s := expected.replied_at + self.wait_s - now) <= 0:
                del self._expected[tenant]
                self._missed(tenant)
            elif longest is not None:
                longest = max(longest, left_s)
        return (bool(self._expected), longest if self._expected else 0.0)

    def forget_unreplied(self) -> None:
        """Stop waiting for tenants whose replies will not be written (no batch in flight)."""
        for tenant in [t for t, e in self._expected.items() if e.replied_at is None]:
            del self._expected[tenant]

    def _missed(self, tenant: str) -> None:
        misses = self._misses[tenant] = self._misses.get(tenant, 0) + 1
        if misses >= MISSES_BEFORE_COOL_OFF:
            del self._misses[tenant]
            self._cooling[tenant] = COOL_OFF_BATCHES
