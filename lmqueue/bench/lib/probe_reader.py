"""The raw probe's consumer: ``python -m lmqueue.bench.lib.probe_reader --url ... --dtype ...``.

A consumer-group reader in its own process, as a worker is, that answers every request entry
with the same precomputed vector on one reply stream, then acknowledges and deletes the entry
(as a worker does). No envelopes, no validation, no backend, no cache: what is left is the cost
of moving the payloads through Redis with redis-py. It imports neither torch nor lmqueue's
client, so it starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import numpy as np
from redis.exceptions import ResponseError

from lmqueue.shared.connections import async_redis

__all__ = ["REQUESTS", "REPLIES", "GROUP", "READY", "serve", "main"]

REQUESTS = "probe:requests"
REPLIES = "probe:replies"
GROUP = "probe"
READY = "probe:ready"
_DTYPES = {"float32": "<f4", "float16": "<f2"}


async def serve(url: str, dtype: str, size: int, batch: int, stop: asyncio.Event) -> None:
    """Answer request entries until `stop` is set."""
    rng = np.random.default_rng(0)
    payload = rng.standard_normal(size).astype(_DTYPES[dtype]).tobytes()
    redis = async_redis(url)
    try:
        try:
            await redis.xgroup_create(REQUESTS, GROUP, id="0", mkstream=True)
        except ResponseError as exc:  # BUSYGROUP: a previous run created it
            if "BUSYGROUP" not in str(exc):
                raise
        await redis.set(READY, "1")
        while not stop.is_set():
            reply = await redis.xreadgroup(
                GROUP, "probe-1", {REQUESTS: ">"}, count=batch, block=200
            )
            if not reply:
                continue
            entries = reply[0][1]
            ids = [entry_id for entry_id, _ in entries]
            async with redis.pipeline(transaction=False) as pipe:
                for _, fields in entries:
                    pipe.xadd(REPLIES, {"id": fields[b"id"], "d": payload})
                pipe.xack(REQUESTS, GROUP, *ids)
                pipe.xdel(REQUESTS, *ids)
                await pipe.execute()
    finally:
        await redis.aclose()


async def _serve_until_signal(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(args.url, args.dtype, args.size, args.batch, stop)


def main(argv: list[str] | None = None) -> int:
    """Run the probe consumer until SIGTERM."""
    parser = argparse.ArgumentParser(prog="python -m lmqueue.bench.lib.probe_reader")
    parser.add_argument("--url", required=True)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument("--size", type=int, required=True, help="floats per reply vector")
    parser.add_argument("--batch", type=int, default=32, help="entries per XREADGROUP")
    asyncio.run(_serve_until_signal(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
