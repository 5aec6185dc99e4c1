"""One tenant's SMC programs in a process of their own, every call journaled (the soak).

``python -m lmqueue.bench.soak.client --url URL --model M --journal FILE ...`` connects with the
tenant's URL and runs SMC programs one after another (`lmqueue.bench.lib.workload`, a new seed
each, cycling through ``--adapters``) until SIGTERM, which lets the running program finish.
Each SMC step's calls are sent one by one, so every call has its own outcome; the step's
begin and end go to the journal (`journal`). A call that fails with a retryable typed error
(the queue unreachable, busy, dead-lettered) is sent again, at most `RETRIES` times; a call
whose deadline passes (or that no deadline ends) is lost, and its program ends there.
Every `--sample-every`-th step, its first row's values at fixed token ids (and its argmax) go
to the journal, for the orchestrator to check against an in-process reference.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lmqueue.shared.errors import BadRequest, DeadlineExceeded, LMQueueError

from ..lib.workload import Workload
from .journal import JournalWriter

__all__ = ["main", "sample_indices", "RETRIES"]

#: Resends of a call after a retryable typed error.
RETRIES = 3
#: A call with no outcome this long after its deadline is lost (the deadline did not fire).
_MARGIN_S = 30.0


def sample_indices(vocab_size: int, count: int = 32) -> list[int]:
    """The token ids whose values a sampled row records (the same in every process)."""
    return sorted(np.random.default_rng(20261126).choice(vocab_size, count, replace=False).tolist())


class _ProgramFailed(Exception):
    """Raised when a call of a step ended without a row: the program cannot go on."""


class _JournaledLM:
    """`batch_next_token_logprobs_numpy` of a `QueueLM`, call by call, with a journal."""

    def __init__(self, lm: Any, journal: JournalWriter, sample_every: int, timeout_s: float):
        self.lm = lm
        self.journal = journal
        self.sample_every = sample_every
        self.timeout_s = timeout_s
        self.indices = sample_indices(lm.vocab_size)
        self.batches = 0
        #: the LoRA adapter of the running program (None: the base model)
        self.adapter: str | None = None

    async def batch_next_token_logprobs_numpy(self, prompts: Sequence[list[int]]) -> np.ndarray:
        """One SMC step's rows; raises `_ProgramFailed` if any call has none."""
        self.batches += 1
        batch = self.batches
        self.journal.write("begin", b=batch, n=len(prompts))
        outcomes = await asyncio.gather(*(self._one(p) for p in prompts))
        rows = [row for row, _, _ in outcomes]
        errors: Counter[str] = Counter(e for _, e, _ in outcomes if e and e != "lost")
        seen: Counter[str] = Counter()
        for _, _, retried in outcomes:
            seen.update(retried)
        lost = sum(1 for _, e, _ in outcomes if e == "lost")
        samples = []
        if batch % self.sample_every == 0 and rows[0] is not None:
            samples.append(self._sample(prompts[0], rows[0]))
        self.journal.write(
            "end", b=batch, ok=sum(r is not None for r in rows), err=dict(errors), lost=lost,
            retries=sum(seen.values()), rerr=dict(seen), extra=0, s=samples,
        )  # fmt: skip
        answered = [row for row in rows if row is not None]
        if len(answered) < len(rows):
            raise _ProgramFailed(f"step {batch}: {dict(errors)}, lost {lost}")
        return np.stack(answered)

    async def _one(self, prompt: list[int]) -> tuple[np.ndarray | None, str | None, list[str]]:
        """(row, None, retried errors), or (None, final error type or "lost", retried)."""
        retried: list[str] = []
        while True:
            try:
                call = self.lm.next_token_logprobs_numpy(prompt, self.adapter)
                row = await asyncio.wait_for(call, self.timeout_s + _MARGIN_S)
                return row, None, retried
            except (DeadlineExceeded, TimeoutError):
                return None, "lost", retried
            except BadRequest as exc:
                return None, type(exc).__name__, retried
            except LMQueueError as exc:
                if len(retried) >= RETRIES:
                    return None, type(exc).__name__, retried
                retried.append(type(exc).__name__)
                await asyncio.sleep(0.5 * len(retried))

    def _sample(self, prompt: list[int], row: np.ndarray) -> dict[str, Any]:
        return {
            "p": list(prompt), "a": self.adapter, "i": self.indices,
            "v": [float(row[i]) for i in self.indices], "am": int(np.argmax(row)),
        }  # fmt: skip


async def _programs(args: argparse.Namespace, stopping: asyncio.Event) -> None:
    from lmqueue.producer import QueueLM

    journal = JournalWriter(Path(args.journal))
    journal.write("start", pid=os.getpid())
    connecting = QueueLM.connect(
        args.model, redis_url=args.url, connect_timeout_s=300,
        timeout_s=args.timeout_s,
    )  # fmt: skip
    async with await connecting as lm:
        proxy = _JournaledLM(lm, journal, args.sample_every, args.timeout_s)
        workload = Workload.for_tokenizer(
            lm.tokenizer, [bytes(t) for t in lm.byte_vocab], args.prompt_tokens,
            particles=args.particles, steps=args.steps,
        )  # fmt: skip
        prompt = [*workload.prompt[: args.prompt_tokens - 2], 100 + args.variant, 200]
        seed, dropped = args.variant * 1_000_003 + os.getpid(), 0
        adapters = [a or None for a in args.adapters.split(",")]
        while not stopping.is_set():
            seed += 1
            proxy.adapter = adapters[seed % len(adapters)]
            try:
                await workload.run(proxy, prompt=prompt, seed=seed)
            except _ProgramFailed as exc:
                journal.write("program_failed", why=str(exc))
            now = lm.stats.get("duplicate_replies", 0)
            journal.write("stats", duplicate_replies=now - dropped, totals=lm.stats)
            dropped = now
    journal.write("stopped")
    journal.close()


def main(argv: list[str] | None = None) -> int:
    """Run programs until SIGTERM."""
    parser = argparse.ArgumentParser(prog="lmqueue.bench.soak.client")
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--journal", required=True)
    parser.add_argument("--adapters", default="", help="LoRA adapters the programs cycle through")
    parser.add_argument("--variant", type=int, default=1)
    parser.add_argument("--particles", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--sample-every", type=int, default=7)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args(argv)

    async def run() -> None:
        stopping = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
        await _programs(args, stopping)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
