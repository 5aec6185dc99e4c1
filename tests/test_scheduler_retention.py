"""Finished experiments expire: kept forever, each one grew the queue Redis for good.

Found by ``lmq bench soak``: its experiment tenant's records, results and index entries (and
arq's results, kept a day) rose for the whole run. A scheduler with ``keep_finished_s`` of
one second shows the fix in seconds: the record and results of a finished experiment carry
that TTL, arq keeps its result no longer, and once they are gone the next finish drops the id
from the tenant's index.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import redis

from lmqueue.devstack import LocalRedis
from lmqueue.producer import Experiments
from lmqueue.shared.keys import KeySpace
from scheduler_processes import SchedulerProcess

KIND = "exp_kinds:count"


async def test_a_finished_experiment_expires_and_leaves_the_index(tmp_path: Path) -> None:
    with LocalRedis() as server:
        config = tmp_path / "scheduler.json"
        config.write_text(json.dumps(
            {"kinds": {KIND: KIND}, "poll_delay_s": 0.1, "keep_finished_s": 1.0}
        ))  # fmt: skip
        scheduler = SchedulerProcess(server.url, "retention-0", config, tmp_path).start()
        admin = redis.Redis.from_url(server.url)
        keys = KeySpace()
        try:
            deadline = time.monotonic() + 60
            while not admin.exists(keys.experiment_kinds()):
                assert time.monotonic() < deadline, scheduler.log()
                time.sleep(0.1)
            async with Experiments.connect(server.url) as experiments:
                first = await experiments.submit(KIND, {"n": 2, "delay_s": 0})
                assert (await experiments.wait(first, 30)).status == "complete"
                ttls = [admin.pttl(keys.experiment_record(first)),
                        admin.pttl(keys.experiment_results(first))]  # fmt: skip
                arq_results = admin.keys("arq:result:*")
                assert arq_results and all(0 < admin.pttl(k) <= 1000 for k in arq_results)
                await asyncio.sleep(1.2)
                second = await experiments.submit(KIND, {"n": 1, "delay_s": 0})
                assert (await experiments.wait(second, 30)).status == "complete"
                listed = [status.id for status in await experiments.list()]
            assert all(0 < ttl <= 1000 for ttl in ttls), ttls
            assert not admin.exists(keys.experiment_record(first), keys.experiment_results(first))
            assert listed == [second]
            assert admin.zrange(keys.experiment_index(), 0, -1) == [second.encode()]
        finally:
            admin.close()
            assert scheduler.stop() in (0, None), scheduler.log()
        assert "Traceback" not in scheduler.log(), scheduler.log()
