"""`LoopProcess`: a tenant's closed loop of calls in a process of its own (the fairness flood).

Tenants are separate programs; hosted in the benchmark's one process, a flood's 2,000 calls
in flight shared the event loop with the light tenant's 16: after each forward the loop
decoded the flood's replies and sent its next calls in between the light tenant's, so the
light tenant's next calls left spread over more than a forward's tail, and how soon a light
tenant's calls return after its replies is what the worker's scheduling (`anticipation`)
depends on. So the flood runs here, in a child process, driven over its stdin and stdout
(a line each way, JSON; no pickle):

* the child reads the tenant's URL from its first line (never on its command line, where
  ``ps`` would show the password), connects, makes one call, freezes its heap, prints
  ``ready``;
* ``start SALT``: it starts the loop (`call_loop.Loop`);
* ``stop``: it stops the loop and prints every call's (finished at, latency) so far;
* end of input: it closes its client and exits.

Times are `time.monotonic`, one clock for every process of the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from lmqueue.shared.heap_freeze import freeze_heap

from .call_loop import PROMPT_TOKENS, Loop, fairness_client_settings
from .json_child import JsonChild
from .load import distinct_prompt

__all__ = ["LoopProcess", "main"]

#: A stopped loop's line holds every call's times (~30 bytes a call, ~10,000 calls a window).
_LINE_LIMIT = 64 << 20


class LoopProcess:
    """A closed loop of `concurrency` calls of the tenant of `redis_url`, in a child process."""

    def __init__(self, model: str, redis_url: str, concurrency: int) -> None:
        argv = [sys.executable, "-m", "lmqueue.bench.lib.loop_process", model, str(concurrency)]
        self.child = JsonChild(argv, _LINE_LIMIT)
        self.redis_url = redis_url

    async def __aenter__(self) -> LoopProcess:
        await self.child.start()
        await self.child.send(self.redis_url)
        await self.child.answer("ready")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.child.close()

    async def start(self, salt: int) -> None:
        """Start the loop; its calls' prompts are distinct per `salt`."""
        await self.child.send(f"start {salt}")
        await self.child.answer("started")

    async def stop(self) -> list[tuple[float, float]]:
        """Stop the loop; every call's (finished at, latency) since it started."""
        await self.child.send("stop")
        return [(at, latency) for at, latency in await self.child.answer("done")]


async def _child(model: str, concurrency: int) -> None:
    from .stack import connect_client

    reader = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), sys.stdin
    )
    redis_url = (await reader.readline()).decode().strip()
    lm = await connect_client(model, fairness_client_settings(redis_url), [])
    try:
        await lm.next_token_logprobs(distinct_prompt(0, 98, PROMPT_TOKENS))
        freeze_heap()
        _say("ready", True)
        loop: Loop | None = None
        while line := (await reader.readline()).decode().split():
            if line[0] == "start":
                loop = Loop(lm, concurrency, int(line[1])).start()
                _say("started", True)
            elif line[0] == "stop" and loop is not None:
                await loop.stop()
                _say("done", [[round(at, 6), round(latency, 6)] for at, latency in loop.done])
                loop = None
    finally:
        await lm.close()


def _say(key: str, value: Any) -> None:
    sys.stdout.write(json.dumps({key: value}) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    """The child: ``python -m lmqueue.bench.lib.loop_process MODEL CONCURRENCY``, URL on stdin."""
    parser = argparse.ArgumentParser(prog="lmqueue.bench.lib.loop_process")
    parser.add_argument("model")
    parser.add_argument("concurrency", type=int)
    args = parser.parse_args(argv)
    asyncio.run(_child(args.model, args.concurrency))


if __name__ == "__main__":
    main()
