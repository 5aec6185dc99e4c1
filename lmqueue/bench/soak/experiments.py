"""The experiment tenant of the soak: ``score`` experiments one after another, each checked.

Tenant ``carol`` submits a ``score`` experiment of a few rows through `Experiments` (her one
URL), waits for it and reads its results. Each must complete with one row per input row, in
order (*missing* and *duplicated* rows are counted), within `_WAIT_S` (else it is *stuck*);
every scored token is kept for the reference check (`verify`). A call that fails because
Redis is restarting is tried again with the same experiment id, which never runs twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from lmqueue.producer import Experiments
from lmqueue.shared.errors import LMQueueError, Unavailable

__all__ = ["ExperimentFigures", "ExperimentLoop"]

logger = logging.getLogger(__name__)

_WORDS = (
    "sea storm island keeper lamp ferry bird cliff tide current wreck bay journal light stairs "
    "lens ships evening autumn weeks young woman colonies northern slowly answered"
).split()
#: How long one experiment may take, faults included, before it counts as stuck.
_WAIT_S = 120.0


@dataclass
class ExperimentFigures:
    """What became of the tenant's experiments."""

    submitted: int = 0
    complete: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    rows: int = 0
    missing_rows: int = 0
    duplicated_rows: int = 0
    #: experiments not finished `_WAIT_S` after their submission
    stuck: int = 0
    retried_calls: int = 0
    #: (context token ids + continuation ids, continuation ids, their log-probabilities)
    scored: list[dict[str, Any]] = field(default_factory=list)
    finished_at: list[tuple[float, int]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able copy without the scored rows."""
        out = asdict(self)
        out.pop("scored")
        out.pop("finished_at")
        return out


class ExperimentLoop:
    """Runs the tenant's experiments until stopped; `figures` says how they went."""

    def __init__(self, url: str, model: str, rows: int = 6, seed: int = 0) -> None:
        self.url, self.model, self.rows = url, model, rows
        self.rng = np.random.default_rng(seed)
        self.figures = ExperimentFigures()
        self._statuses: Counter[str] = Counter()

    async def run(self, stopping: asyncio.Event) -> None:
        """One experiment after another until `stopping` is set (the running one finishes)."""
        round_ = 0
        while not stopping.is_set():
            round_ += 1
            rows = [self._row() for _ in range(self.rows)]
            experiment_id = f"soak-{int(time.time())}-{round_}"
            try:
                await self._one(experiment_id, rows)
            except TimeoutError:  # not finished in _WAIT_S: stuck (counted as lost)
                logger.warning("experiment %s: not finished in %s s", experiment_id, _WAIT_S)
                self.figures.stuck += 1
            except LMQueueError as exc:
                logger.warning("experiment %s: %s", experiment_id, exc)
                self._statuses[type(exc).__name__] += 1
                await asyncio.sleep(1.0)  # a refusal that lasts is not hammered
            self.figures.statuses = dict(self._statuses)

    async def _one(self, experiment_id: str, rows: list[dict[str, str]]) -> None:
        params = {"rows": rows, "batch_size": 2}
        await self._retrying(lambda ex: ex.submit("score", params, model=self.model,
                                                  experiment_id=experiment_id))  # fmt: skip
        self.figures.submitted += 1
        status = await self._retrying(lambda ex: ex.wait(experiment_id, _WAIT_S))
        self._statuses[status.status] += 1
        if status.status != "complete":
            logger.warning("experiment %s ended %s: %s", experiment_id, status.status,
                           status.error)  # fmt: skip
            return
        results = await self._retrying(lambda ex: ex.results(experiment_id))
        self.figures.complete += 1
        self._count_rows(results, len(rows))
        self.figures.finished_at.append((time.time(), len(results)))

    def _count_rows(self, results: list[dict[str, Any]], expected: int) -> None:
        seen = Counter(int(row["index"]) for row in results)
        self.figures.rows += len(results)
        self.figures.missing_rows += sum(1 for i in range(expected) if i not in seen)
        self.figures.duplicated_rows += sum(n - 1 for n in seen.values() if n > 1)
        for row in results:
            self.figures.scored.append({
                "context": row["context"], "continuation": row["continuation"],
                "tokens": row["tokens"], "token_logprobs": row["token_logprobs"],
            })  # fmt: skip

    async def _retrying(self, call: Any) -> Any:
        """`call(experiments)` on a fresh connection, again while Redis is unreachable."""
        for attempt in range(60):
            try:
                async with Experiments.connect(self.url) as experiments:
                    return await call(experiments)
            except (LMQueueError, ConnectionError) as exc:
                if attempt == 59 or not _transient(exc):
                    raise
                self.figures.retried_calls += 1
                await asyncio.sleep(1.0)
        raise AssertionError("unreachable")

    def _row(self) -> dict[str, str]:
        words = self.rng.choice(_WORDS, size=int(self.rng.integers(3, 7))).tolist()
        cut = int(self.rng.integers(1, len(words)))
        return {"context": " ".join(words[:cut]), "continuation": " " + " ".join(words[cut:])}


def _transient(exc: BaseException) -> bool:
    """Whether `exc` is Redis being away for a while (Unavailable and its kin)."""
    return isinstance(exc, Unavailable | ConnectionError) and not isinstance(exc, LookupError)
