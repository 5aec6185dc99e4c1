"""What every fault test does: drive concurrent requests, check each outcome, count figures.

A `Load` sends distinct prompts through a real `QueueLM` all at once and records, for each,
its one outcome, how long it took and a digest of its result; `Figures` then compares every
result with the in-process mock backend (bit-identical by construction) and counts what was
answered, wrong, lost, late or duplicated. Faults are injected while a load runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from lmqueue.producer import QueueLM
from lmqueue.shared.connections import connect_async_redis
from lmqueue.shared.errors import Cancelled, DeadlineExceeded
from lmqueue.shared.keys import WORKER_GROUP, KeySpace
from lmqueue.shared.settings import ClientSettings, RedisSettings

MODEL = "smollm2-135m"
KEYS = KeySpace()
VOCAB = 49152
#: Token ids that fault tests give a meaning (poison, crash); ordinary prompts avoid them.
RESERVED_TOKENS = frozenset({666, 777})
#: An outcome this much after its deadline counts as late.
LATE_SLACK_S = 1.0


@dataclass
class Figures:
    """What one fault scenario did to its requests."""

    scenario: str
    sent: int = 0
    answered: int = 0
    wrong: int = 0
    lost: int = 0
    late: int = 0
    duplicates: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    time_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able copy."""
        return asdict(self)

    def line(self) -> str:
        """One printable line."""
        head = (
            f"{self.scenario}: sent {self.sent}, answered {self.answered}, wrong {self.wrong}, "
            f"lost {self.lost}, late {self.late}, duplicates {self.duplicates}, "
            f"errors {self.errors or 0}, {self.time_s:.1f} s"
        )
        return head + "".join(f", {key} {value}" for key, value in self.extra.items())


def make_prompts(count: int, seed: int, tokens: Iterable[int] = ()) -> list[list[int]]:
    """`count` distinct random prompts avoiding the reserved tokens; `tokens` appended to each."""
    rng = np.random.default_rng(seed)
    prompts: dict[tuple[int, ...], None] = {}
    while len(prompts) < count:
        prompt = rng.integers(0, VOCAB, size=int(rng.integers(1, 24))).tolist()
        if not RESERVED_TOKENS.intersection(prompt):
            prompts[(*prompt, *tokens)] = None
    return [list(p) for p in prompts]


def _digest(values: Any) -> str:
    array = np.ascontiguousarray(values, dtype=np.float32)
    return hashlib.blake2b(array.tobytes(), digest_size=16).hexdigest()


class Load:
    """Every prompt requested at once through `lm`; each outcome timed and recorded.

    Args:
        expected_errors: prompt index -> the error type that prompt must end in.
    """

    def __init__(
        self,
        lm: QueueLM,
        prompts: Sequence[list[int]],
        expected_errors: dict[int, type[BaseException]] | None = None,
    ) -> None:
        self.lm = lm
        self.prompts = list(prompts)
        self.expected_errors = expected_errors or {}
        self.outcomes: list[tuple[str, float] | BaseException | None] = [None] * len(prompts)
        self.done = 0
        self._progress = asyncio.Event()

    async def run(self, scenario: str) -> Figures:
        """Send everything, wait for every outcome, and count (results are checked later)."""
        started = time.monotonic()
        await asyncio.gather(*(self._one(i) for i in range(len(self.prompts))))
        figures = Figures(scenario, sent=len(self.prompts), time_s=time.monotonic() - started)
        figures.duplicates = self.lm.stats["duplicate_replies"]
        return figures

    async def _one(self, index: int) -> None:
        started = time.monotonic()
        try:
            vector = await self.lm.next_token_logprobs(self.prompts[index])
            self.outcomes[index] = (_digest(vector.numpy()), time.monotonic() - started)
        except Exception as exc:  # every outcome is data here
            exc.elapsed_s = time.monotonic() - started  # type: ignore[attr-defined]
            self.outcomes[index] = exc
        self.done += 1
        self._progress.set()

    async def wait_done(self, count: int, timeout_s: float = 60) -> None:
        """Return once `count` outcomes are in."""
        deadline = time.monotonic() + timeout_s
        while self.done < count:
            self._progress.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"only {self.done} of {count} outcomes in {timeout_s} s")
            try:
                await asyncio.wait_for(self._progress.wait(), remaining)
            except TimeoutError:
                continue

    def check(self, figures: Figures, reference: Any) -> Figures:
        """Compare every result with the in-process backend and count every outcome."""
        timeout_s = self.lm.settings.timeout_s
        errors: Counter[str] = Counter()
        for index, outcome in enumerate(self.outcomes):
            if outcome is None:
                figures.lost += 1
                continue
            elapsed_s = outcome[1] if isinstance(outcome, tuple) else outcome.elapsed_s  # type: ignore
            if timeout_s and elapsed_s > timeout_s + LATE_SLACK_S:
                figures.late += 1
            expected = self.expected_errors.get(index)
            if isinstance(outcome, BaseException):
                errors[type(outcome).__name__] += 1
                if isinstance(outcome, DeadlineExceeded | Cancelled) and expected is None:
                    figures.lost += 1
                elif expected is None or not isinstance(outcome, expected):
                    figures.wrong += 1
                continue
            right = _digest(reference.logprobs_of(self.prompts[index]))
            if expected is not None or outcome[0] != right:
                figures.wrong += 1
            else:
                figures.answered += 1
        figures.errors = dict(errors)
        return figures


def assert_clean(figures: Figures, expected_errors: dict[str, int] | None = None) -> None:
    """Every request got its one right outcome, in time; errors are exactly those expected."""
    expected_errors = expected_errors or {}
    assert figures.wrong == 0, figures.line()
    assert figures.lost == 0, figures.line()
    assert figures.late == 0, figures.line()
    assert figures.errors == expected_errors, figures.line()
    assert figures.answered == figures.sent - sum(expected_errors.values()), figures.line()


@asynccontextmanager
async def connect(url: str, **settings: Any):
    """A `QueueLM` of the test model at `url` (60 s deadlines unless overridden)."""
    stall_timeout_s = settings.pop("stall_timeout_s", 10.0)
    values: dict[str, Any] = {"timeout_s": 60.0, "connect_timeout_s": 60.0, **settings}
    config = ClientSettings(redis=RedisSettings(url=url, stall_timeout_s=stall_timeout_s), **values)
    lm = await QueueLM.connect(MODEL, settings=config)
    try:
        yield lm
    finally:
        await lm.close()


@asynccontextmanager
async def probe(url: str):
    """A plain asyncio client for looking at Redis from the test."""
    client = await connect_async_redis(url)  # a cluster client where `url` is a cluster node
    try:
        yield client
    finally:
        await client.aclose()


async def until(
    check: Callable[[], Awaitable[Any]], timeout_s: float = 30, every_s: float = 0.02
) -> Any:
    """Poll `check` until it returns something truthy; return that."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met in {timeout_s} s")
        await asyncio.sleep(every_s)


async def pending_of(redis: aioredis.Redis, consumer: str) -> int:
    """Entries delivered to `consumer` and not yet acknowledged."""
    try:
        summary = await redis.xpending(KEYS.requests(MODEL), WORKER_GROUP)
    except aioredis.ResponseError:
        return 0
    for row in summary.get("consumers") or []:
        name = row["name"].decode() if isinstance(row["name"], bytes) else row["name"]
        if name == consumer:
            return int(row["pending"])
    return 0


async def settled_streams(redis: aioredis.Redis, timeout_s: float = 30) -> dict[str, int]:
    """Wait until the request stream is empty and nothing is pending; what is left where."""
    stream = KEYS.requests(MODEL)

    async def empty() -> dict[str, int] | None:
        left = {"queued": int(await redis.xlen(stream)), "pending": 0}
        if await redis.exists(stream):
            try:
                left["pending"] = int((await redis.xpending(stream, WORKER_GROUP))["pending"])
            except aioredis.ResponseError:
                pass
        left["dead_letters"] = int(await redis.xlen(KEYS.dead_letters(MODEL)))
        return left if not left["queued"] and not left["pending"] else None

    try:
        return await until(empty, timeout_s, every_s=0.1)
    except TimeoutError:
        left = {"queued": int(await redis.xlen(stream))}
        raise AssertionError(f"request stream did not drain: {left}") from None
