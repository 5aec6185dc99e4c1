"""A client process that submits requests and then waits to be killed before reading replies.

Run as ``python -m tests.faults.abandoning_client <redis-url> <count>``; it prints
``SUBMITTED <client-id>`` once every request is in the request stream.
"""

from __future__ import annotations

import asyncio
import sys

from lmqueue.producer import QueueLM
from lmqueue.shared.settings import ClientSettings, RedisSettings


async def main(url: str, count: int) -> None:
    settings = ClientSettings(redis=RedisSettings(url=url), connect_timeout_s=60)
    lm = await QueueLM.connect("smollm2-135m", settings=settings)
    pending = [asyncio.ensure_future(lm.next_token_logprobs([3, n, n + 1])) for n in range(count)]
    while lm.stats["sent"] < count:
        await asyncio.sleep(0.01)
    print(f"SUBMITTED {lm.client_id}", flush=True)
    await asyncio.gather(*pending)  # killed long before this returns


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
