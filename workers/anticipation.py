"""Anticipation: before picking the next batch, wait a moment for a returning tenant's calls.

A closed-loop tenant (an SMC sampler: each step's calls go out when the last step's replies
arrive) whose calls were in the forward now ending has nothing queued when late binding picks
the next batch (`late_binding`: a fifth of a forward before its end). Its next calls arrive a
few milliseconds after its replies, when the next forward, full of other tenants' rows, has
started: they wait for all of it and then run in the one after, two full forwards: about three
times its latency alone, every call (BENCHMARKS.md, fairness). So a busy worker waits for a
*returning* tenant: while a tenant that had calls in a batch sent to the backend has fewer
queued than it had there, the next batch is not picked until that tenant's replies are written
and then either as many calls of it are queued again, or its wait is over (anticipatory
scheduling, as disk schedulers wait for a process's next read rather than seek away). While no
other tenant has requests queued, any of its calls queued end the wait: the hold would hold up
only those calls (a sampler whose step has fewer distinct prompts than the last, or whose step
is larger than one batch, waited out ``anticipate_ms`` each step; BENCHMARKS.md, model).

While a returning tenant is awaited it also keeps its place in the fair share
(`FairShare.add`'s credit, one batch's worth at most): idle only between its replies and its
next calls, it would otherwise be lifted to the others' level every round and get less than
its share though it asks for no more.

The cost is the backend's idle time, so the wait is bounded by what it costs: while other
tenants' requests are queued, the backend idles at most `IDLE_SHARE` of a forward (the
backend's own time per forward, `BackendOccupancy.compute_s`) per batch, counted from when it went
idle, and never more than ``anticipate_ms`` after the tenant's replies (a wait that holds up no
one is bounded by the latter only, and is no miss). The same setting holds for a slow CPU
forward (a local client's round trip fits in a quarter of it) and a fast GPU forward (no round
trip fits: the tenant is soon not waited for and the worker stays work-conserving; its calls
wait one short forward instead). What the backend idles when the tenant is caught is its round
trip, not the bound: the throughput the fairness benchmark loses (BENCHMARKS.md, fairness). A
tenant with a backlog is never waited for; one whose wait ran
out twice in a row (it stopped, thinks longer, its round trip is longer than the bound, or
another worker read its calls) is not waited for during its next `COOL_OFF_BATCHES` batches,
twice as many each time it runs out again right after (up to `MAX_COOL_OFF_BATCHES`), then
tried again. A wait that ran out with some of its calls back is no miss: a tenant of several
programs (an SMC sampler per prompt) sends each program's calls when that program's replies
are in, and one starting its next run may be late while the others are back; counted as
misses, such a tenant was soon not waited for at all and each of its steps waited for a forward
of others' rows first (BENCHMARKS.md, fairness, real model).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "COOL_OFF_BATCHES", "IDLE_SHARE", "MAX_COOL_OFF_BATCHES", "AwaitedFirst", "ReturningTenants",
]  # fmt: skip

#: The most the backend idles for a returning tenant per batch, as a share of a forward.
IDLE_SHARE = 0.25
#: Waits that ran out in a row before a tenant is not waited for a while ...
MISSES_BEFORE_COOL_OFF = 2
#: ... and for how many of its batches (doubled each time it runs out again right after) ...
COOL_OFF_BATCHES = 16
#: ... up to this many.
MAX_COOL_OFF_BATCHES = 1024


@dataclass(slots=True)
class _Expected:
    calls: int  # how many of its calls the batch sent to the backend held
    cost: float  # what they were charged (fair-share cost units)
    replied_at: float | None = None  # when their replies were written


class ReturningTenants:
    """Tenants whose next calls the next batch should wait for, and for how long.

    Args:
        wait_s: the longest a tenant's next calls are waited for after its replies are written
            (the worker's ``anticipate_ms``; 0 waits for none).
        clock: monotonic seconds (a test's fake clock).
        idle_share: the most the backend idles per batch for returning tenants, as a share of
            a forward (`IDLE_SHARE`).
    """

    def __init__(
        self,
        wait_s: float,
        clock: Callable[[], float] = time.monotonic,
        idle_share: float = IDLE_SHARE,
    ) -> None:
        self.wait_s = wait_s
        self.clock = clock
        self.idle_share = idle_share
        self._expected: dict[str, _Expected] = {}
        self._misses: dict[str, int] = {}  # waits run out in a row, by tenant
        self._cooling: dict[str, int] = {}  # batches of the tenant not to wait after
        self._cool_off: dict[str, int] = {}  # its next cool-off, if it runs out again after

    def sent(self, tenant: str, calls: int, cost: float, queued: int = 0) -> None:
        """A batch holding `calls` of `tenant`'s requests, charged `cost`, went to the backend,
        leaving `queued` of them for later batches (as many as `calls`: not awaited)."""
        if self._cooling.get(tenant):
            self._cooling[tenant] -= 1
            self._expected.pop(tenant, None)
        elif self.wait_s > 0 and self.idle_share > 0 and 0 < calls and queued < calls:
            self._expected[tenant] = _Expected(calls, cost)
        else:
            self._expected.pop(tenant, None)

    def awaits(self, tenant: str) -> bool:
        """Whether the next pick may wait for `tenant`'s calls (its replies come first)."""
        return tenant in self._expected

    def credit(self, tenant: str) -> float:
        """The fair-share credit a returning tenant keeps (`FairShare.add`): what its calls in
        the last batch cost, while they are awaited; 0 for any other tenant."""
        expected = self._expected.get(tenant)
        return expected.cost if expected is not None else 0.0

    def replied(self, tenant: str) -> None:
        """The replies of `tenant`'s part of a batch are written, and the backend is done with
        the batch (the worker calls this at the later of the two): its next calls may come.
        Counted from its replies alone, a tenant answered while the batch's other rows still
        computed (a split batch) ran out of its wait before the next pick could take it."""
        expected = self._expected.get(tenant)
        if expected is not None and expected.replied_at is None:
            expected.replied_at = self.clock()

    def waiting(
        self,
        backlog: Callable[[str], int],
        idle_since: float | None = None,
        forward_s: float = 0.0,
        queued: int | None = None,
    ) -> tuple[bool, float | None]:
        """Whether to hold the next pick, and at most how long (None: until a reply is written).

        `backlog(tenant)` is how many of the tenant's requests are queued for picking; a
        tenant with as many as it had in its batch, or whose wait is over, is forgotten.
        `idle_since`: when the backend went idle (None: it is busy); `forward_s`: how long a
        forward takes (0: not known yet); `queued`: the requests queued of every tenant (None:
        not known). Only while others' requests are queued does the idle cost anything: then
        it is bounded by a share of a forward, and a wait that ran out counts as a miss.
        """
        now = self.clock()
        awaited = sum(backlog(tenant) for tenant in self._expected)
        contended = queued is None or queued > awaited
        idle_end = None
        if contended and idle_since is not None and forward_s > 0:
            idle_end = idle_since + self.idle_share * forward_s
        longest: float | None = 0.0
        for tenant, expected in list(self._expected.items()):
            end = idle_end
            if expected.replied_at is not None:
                end = min(expected.replied_at + self.wait_s, end or float("inf"))
            queued_own = backlog(tenant)
            if queued_own >= expected.calls or (queued_own and not contended):
                # Back, or (no one else queued) some of it is: holding would only hold up its
                # own calls, such as a sampler's step with fewer distinct prompts than the last
                # or the rest of a step larger than a batch (BENCHMARKS.md, model).
                del self._expected[tenant]
                self._misses.pop(tenant, None)
                self._cool_off.pop(tenant, None)
            elif end is None:
                longest = None
            elif (left_s := end - now) <= 0:
                del self._expected[tenant]
                if not queued_own and contended:
                    self._missed(tenant)
                elif queued_own:  # some are back: a live loop, one of its programs late
                    self._misses.pop(tenant, None)
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
            batches = self._cool_off.get(tenant, COOL_OFF_BATCHES)
            self._cooling[tenant] = batches
            self._cool_off[tenant] = min(2 * batches, MAX_COOL_OFF_BATCHES)


class AwaitedFirst:
    """An awaited tenant's replies are written before the other parts' of its batch: until its
    next calls are back the backend idles, and other replies written ahead of its own on the
    worker's one writer thread lengthened that idle by their writing (BENCHMARKS.md, fairness,
    and the trace in its history). The other parts then wait until the next batch goes to the
    backend as well, since their writing and their clients' reading, on the same Redis and
    cores, lengthened the awaited tenant's round trip too, and once the next batch was picked
    their writing still delayed its forward's start (decoding it, on the same cores; a trace:
    1.4-2.2 ms from the pick to the forward); their clients have calls queued, so theirs can
    wait.

    Args:
        parts: how many of the batch's parts are awaited tenants'.
        next_forward: set when the worker's next batch goes to the backend (None: the others
            do not wait for it).
        forward_wait_s: the longest the others wait for it (the worker's ``anticipate_ms``).
    """

    def __init__(
        self, parts: int, next_forward: asyncio.Event | None = None, forward_wait_s: float = 0.0
    ) -> None:
        self._left = parts
        self._next_forward = next_forward
        self._forward_wait_s = forward_wait_s
        self._written = asyncio.Event()
        if parts <= 0:
            self._written.set()

    def written(self) -> None:
        """One awaited part's replies are written, or never will be (once per such part)."""
        self._left -= 1
        if self._left <= 0:
            self._written.set()

    async def wait(self, timeout_s: float) -> None:
        """Wait until every awaited part's replies are written, at most `timeout_s` (a safety
        bound: their writing is bounded by Redis's stall timeout and retries), then for the
        next batch's forward, at most ``forward_wait_s``."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._written.wait(), timeout_s)
        if self._next_forward is not None and self._forward_wait_s > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._next_forward.wait(), self._forward_wait_s)
