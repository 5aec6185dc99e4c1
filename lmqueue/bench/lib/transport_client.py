"""`ClientProcess`: one client of ``lmq bench transport --clients N``, in a process of its own.

Many programs share a worker from many processes; hosted in the benchmark's one process they
would share one event loop and one reply thread. Each runs here, driven over stdin and stdout
(a JSON line each way; no pickle, the URLs never on a command line, where ``ps`` shows them):

* first line: its settings (``{"url": ..., "cache_url": ..., "dtype": ..., ...}``); it
  connects, makes one call and prints ``{"ready": true}``;
* ``{"salt": S, "warmup_s": W, "measure_s": M}``: it keeps its calls outstanding for W + M
  seconds of distinct prompts and prints what the last M seconds saw: replies, elapsed
  seconds, its CPU seconds, and those of its threads other than the event loop's;
* end of input: it closes its client and exits.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import psutil

from .json_child import JsonChild
from .stack import CpuMeter

__all__ = ["ClientProcess", "ThreadMeter", "main", "thread_cpu_s"]


class ClientProcess:
    """A closed loop of `concurrency` calls in a child process (see the module docstring)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self.child = JsonChild([sys.executable, "-m", "lmqueue.bench.lib.transport_client"])

    async def __aenter__(self) -> ClientProcess:
        await self.child.start()
        await self.child.send(json.dumps(self.settings))
        await self.child.answer("ready")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.child.close()

    async def window(self, salt: int, warmup_s: float, measure_s: float) -> dict[str, Any]:
        """Run one window; what its last `measure_s` seconds saw."""
        order = {"salt": salt, "warmup_s": warmup_s, "measure_s": measure_s}
        await self.child.send(json.dumps(order))
        figures: dict[str, Any] = await self.child.answer("window")
        return figures


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of process `pid` so far, by thread id."""
    try:
        return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}
    except psutil.Error:
        return {}


class ThreadMeter(CpuMeter):
    """A `CpuMeter` that also splits each of `split`'s processes into its main thread (the
    event loop's) and its other threads (a worker's writer, a client's reply thread)."""

    def __init__(self, groups: Mapping[str, Sequence[int]], split: Sequence[int]) -> None:
        super().__init__(groups)
        self.split = list(split)
        self._before: dict[int, dict[int, float]] = {}
        #: After `stop`: CPU seconds by pid, ``{"main": s, "other": s}``.
        self.threads: dict[int, dict[str, float]] = {}

    def start(self) -> None:
        self._before = {pid: thread_cpu_s(pid) for pid in self.split}
        super().start()

    def stop(self) -> dict[str, float]:
        spent = super().stop()
        for pid in self.split:
            after, before = thread_cpu_s(pid), self._before.get(pid, {})
            each = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
            main = each.pop(pid, 0.0)
            self.threads[pid] = {"main": round(main, 4), "other": round(sum(each.values()), 4)}
        return spent


async def _child() -> None:
    from lmqueue.shared.settings import ClientSettings, RedisSettings

    from .load import closed_loop, distinct_prompt
    from .stack import connect_client

    reader = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), sys.stdin
    )
    config = json.loads(await reader.readline())
    settings = ClientSettings(
        redis=RedisSettings(url=config["url"], cache_url=config.get("cache_url")),
        wire_dtype=config["dtype"], use_shared_cache=config.get("use_shared_cache", False),
    )  # fmt: skip
    lm = await connect_client(config["model"], settings, [])
    pid = os.getpid()
    try:
        await lm.next_token_logprobs(distinct_prompt(0, 99_999))
        _say("ready", True)
        while line := await reader.readline():
            order = json.loads(line)

            async def call(index: int, salt: int = int(order["salt"])) -> None:
                await lm.next_token_logprobs(distinct_prompt(index, salt))

            meter = ThreadMeter({"client": [pid]}, [pid])
            window = await closed_loop(
                call, int(config["concurrency"]), float(order["warmup_s"]),
                float(order["measure_s"]), meter,
            )  # fmt: skip
            threads = meter.threads[pid]
            _say("window", {**window.as_dict(), "threads_cpu_s": threads, "stats": lm.stats})
    finally:
        await lm.close()


def _say(key: str, value: Any) -> None:
    sys.stdout.write(json.dumps({key: value}) + "\n")
    sys.stdout.flush()


def main() -> None:
    """The child: ``python -m lmqueue.bench.lib.transport_client``, settings on stdin."""
    asyncio.run(_child())


if __name__ == "__main__":
    main()
