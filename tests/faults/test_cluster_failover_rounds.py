"""Redis Cluster: a master killed mid-burst, round after round, under one client (issue 26).

redis-py 5.x's asyncio cluster client can lose every node of its startup list after a master
dies (see `shared.cluster_client`); it then never reconnects, and every request in flight ends
in DeadlineExceeded although the cluster is healthy again. Which task hits the dead node first
is a race, so this scenario gives it many chances: one cluster (node timeout 1 s), two mock
workers and one `QueueLM` live through `LMQ_FAILOVER_ROUNDS` rounds (3 by default, for CI).
In each, 1,000 requests are sent at once and, after a quarter is answered, a master is
SIGKILLed; every request must still get its one right answer within its 30 s deadline. The
victim rotates: the master named in the client's URL, the master of the request stream, the
master of the client's reply stream. Between rounds the killed node is restarted and promoted
back (``CLUSTER FAILOVER``), so every round starts from the same layout.

Run by hand for the figures of docs/RELIABILITY.md::

    LMQ_FAILOVER_ROUNDS=20 .venv/bin/python -m pytest -q -s \
        tests/faults/test_cluster_failover_rounds.py
"""

from __future__ import annotations

import asyncio
import gc
import os
import re

import pytest

from lmqueue.devstack import LocalCluster

from .harness import KEYS, MODEL, Load, assert_clean, connect, make_prompts

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    # redis-py drops node objects of a failed node unclosed (see test_cluster_faults.py)
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
    pytest.mark.timeout(60 + 60 * int(os.environ.get("LMQ_FAILOVER_ROUNDS", "3"))),
]

ROUNDS = int(os.environ.get("LMQ_FAILOVER_ROUNDS", "3"))
PER_ROUND = 1000
VICTIMS = ("url", "requests", "replies")
_WORKER_ENV = {"LMQ_BATCH_SIZE": "16", "LMQ_CLAIM_IDLE_MS": "3000"}
_REBUILT = re.compile(r"the cluster client lost every node")


@pytest.fixture(autouse=True)
def _collect_dropped_connections():
    yield
    gc.collect()


def _url_master(cluster: LocalCluster) -> int:
    """A master that does not serve the request stream: the client's URL names it."""
    requests = cluster.port_of_slot(cluster.slot_of(KEYS.requests(MODEL)))
    return next(port for port in cluster.master_ports() if port != requests)


def _victim(cluster: LocalCluster, kind: str, url_port: int, client_id: str) -> int:
    if kind == "url":
        return url_port
    key = KEYS.requests(MODEL) if kind == "requests" else KEYS.replies(client_id)
    return cluster.port_of_slot(cluster.slot_of(key))


async def test_every_request_is_answered_when_a_master_dies_mid_burst_round_after_round(
    fault_cluster, workers, reference, record
):
    url_port = _url_master(fault_cluster)
    url = fault_cluster.url_of(url_port)
    # the client connects while the workers start: like them, it reads the slot map of a
    # young cluster, whose replicas CLUSTER SLOTS may not list yet (see test_cluster_client_race)
    spawning = asyncio.create_task(asyncio.to_thread(
        workers.spawn, url, 2, backend_opts={"batch_delay_s": 0.05}, env=_WORKER_ENV
    ))  # fmt: skip
    async with connect(url, timeout_s=30.0) as lm:
        pool = await spawning
        for round_ in range(ROUNDS):
            kind = VICTIMS[round_ % len(VICTIMS)]
            port = _victim(fault_cluster, kind, url_port, lm.channel.client_id)
            duplicates_before = lm.stats["duplicate_replies"]
            load = Load(lm, make_prompts(PER_ROUND, seed=1000 + round_))
            running = asyncio.create_task(load.run(f"cluster round {round_}: kill {kind} master"))
            await load.wait_done(PER_ROUND // 4)
            await asyncio.to_thread(fault_cluster.kill_master, port)
            figures = load.check(await running, reference)
            figures.duplicates -= duplicates_before
            figures.extra.update(
                killed_port=port, client_rebuilds=lm.stats["cluster_rebuilds"],
                worker_rebuilds=sum(len(_REBUILT.findall(w.log())) for w in pool),
            )  # fmt: skip
            record(figures)
            assert_clean(figures)
            await asyncio.to_thread(fault_cluster.restart, port)
            await asyncio.to_thread(fault_cluster.promote, port)
    await _collect_while_the_loop_runs()


async def _collect_while_the_loop_runs() -> None:
    """Let redis-py's pending disconnects run, then collect the node objects it dropped, while
    the event loop is open and this test's warning filter applies: collected later (after the
    loop closed, or at exit) their ResourceWarnings fail the pytest session itself."""
    await asyncio.sleep(0.2)
    gc.collect()
