"""The soak's client journal: what each client process asked and what became of every call.

A client process appends one JSON line per event to its journal file and flushes it, so a
``kill -9`` loses at most the line being written (a torn last line is skipped on reading):

* ``{"ev": "start", "t": ..., "pid": ...}``: a process (re)started; batch numbers restart.
* ``{"ev": "begin", "b": B, "n": N, "t": ...}``: batch B of N calls is about to be sent.
* ``{"ev": "end", "b": B, "ok": .., "err": {type: count}, "retries": .., "lost": ..,
  "extra": .., "t": ..., "s": [samples]}``: every call of batch B has its one outcome.
* ``{"ev": "stats", ...}``: the client's counters after a program (dropped duplicate replies).

`tally` folds journals into one `Tally`: a call is *answered* (its row came back; a sample of
rows is checked against the in-process reference later), a *typed error* after its retries,
*lost* (its deadline passed, or no outcome at all within the deadline and a margin), or
*abandoned* (its batch had begun when its process was killed: the fault, not the system,
dropped it). *Duplicated* counts outcomes beyond one per call; *retried* the resends after a
typed error that ended answered.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = ["JournalWriter", "Tally", "read_events", "tally", "answered_times"]


class JournalWriter:
    """Appends events to one journal file, each flushed before the call returns."""

    def __init__(self, path: Path) -> None:
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, event: str, **fields: Any) -> None:
        """Append one event line, stamped with the wall clock."""
        line = json.dumps(
            {"ev": event, "t": round(time.time(), 3), **fields}, separators=(",", ":")
        )
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def read_events(path: Path) -> Iterator[dict[str, Any]]:
    """Every whole event of a journal, in order (a torn or foreign line is skipped)."""
    if not path.exists():
        return
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and "ev" in event:
                yield event


@dataclass
class Tally:
    """The outcomes of every call of some journals."""

    calls: int = 0
    answered: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    lost: int = 0
    abandoned: int = 0
    duplicated: int = 0
    retried: int = 0
    retried_errors: dict[str, int] = field(default_factory=dict)
    in_flight: int = 0
    processes: int = 0
    duplicate_replies_dropped: int = 0
    samples: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able copy without the samples."""
        out = asdict(self)
        out.pop("samples")
        return out

    @property
    def accounted(self) -> bool:
        """Whether every call has exactly one outcome of the four kinds."""
        settled = self.answered + sum(self.errors.values()) + self.lost + self.abandoned
        return settled + self.in_flight == self.calls


def tally(journals: Iterable[Path], final: bool = True) -> Tally:
    """Fold journals into one `Tally`.

    A batch begun and never ended counts as abandoned where a later ``start`` of its process
    follows it (the process was killed); the last process's open batch is in flight, or, when
    `final` (every client has stopped cleanly), abandoned too.
    """
    out = Tally()
    errors: Counter[str] = Counter()
    for path in journals:
        open_batches: dict[int, int] = {}
        for event in read_events(path):
            kind = event["ev"]
            if kind == "start":
                out.processes += 1
                out.abandoned += sum(open_batches.values())
                open_batches = {}
            elif kind == "begin":
                out.calls += int(event["n"])
                open_batches[int(event["b"])] = int(event["n"])
            elif kind == "end":
                _settle(out, errors, open_batches, event)
            elif kind == "stats":
                out.duplicate_replies_dropped += int(event.get("duplicate_replies", 0))
        if final:
            out.abandoned += sum(open_batches.values())
        else:
            out.in_flight += sum(open_batches.values())
    out.errors = dict(errors)
    return out


def _settle(
    out: Tally, errors: Counter[str], open_batches: dict[int, int], event: dict[str, Any]
) -> None:
    """Count one ``end`` event; a batch ended twice counts all its calls as duplicated."""
    batch = int(event["b"])
    if batch not in open_batches:
        out.duplicated += int(event.get("ok", 0)) + sum(event.get("err", {}).values())
        return
    del open_batches[batch]
    out.answered += int(event.get("ok", 0))
    errors.update({str(k): int(v) for k, v in event.get("err", {}).items()})
    out.lost += int(event.get("lost", 0))
    out.duplicated += int(event.get("extra", 0))
    out.retried += int(event.get("retries", 0))
    for name, count in event.get("rerr", {}).items():
        out.retried_errors[name] = out.retried_errors.get(name, 0) + int(count)
    out.samples.extend(event.get("s", ()))


def answered_times(journals: Iterable[Path]) -> list[tuple[float, int]]:
    """(wall time, calls answered) of every ended batch: the throughput series."""
    points = []
    for path in journals:
        for event in read_events(path):
            if event["ev"] == "end" and event.get("ok"):
                points.append((float(event["t"]), int(event["ok"])))
    return sorted(points)
