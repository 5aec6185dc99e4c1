"""The experiment scheduler with its data plane on a Redis Cluster, its control on one instance.

Real processes as in test_scheduler.py: a mock-backend worker serving from the session
cluster, two scheduler processes (``--config`` names the session single instance as the
control plane), tenants `default` and alice (an ACL user on every node) submitting with
their one cluster URL. The inboxes of the two tenants hash to different slots, so the
dispatcher reads them with one XREADGROUP per slot group.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from lmqueue.devstack import LocalCluster, LocalRedis, WorkerProcess
from lmqueue.producer import Experiments
from lmqueue.scheduler.main import main as scheduler_main
from lmqueue.shared.connections import sync_redis
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.tenants import TenantConfig
from lmqueue.tenant_admin import TenantAdmin
from lmqueue.workers.backends.mock import MockAsyncLM
from scheduler_processes import SchedulerProcess

pytestmark = pytest.mark.cluster

MODEL = "smollm2-135m"
KINDS = ("exp_kinds:count",)


@pytest.fixture(scope="module")
def planes(redis_cluster: LocalCluster, redis_server: LocalRedis) -> Iterator[tuple[str, str]]:
    """(data URL: a cluster node, control URL: the single instance), both flushed once."""
    redis_cluster.flush()
    if redis_server.process is None or redis_server.process.poll() is not None:
        redis_server.start()  # a test elsewhere killed it
    control = redis.Redis.from_url(redis_server.url)
    control.flushall()
    control.close()
    yield redis_cluster.url, redis_server.url


@pytest.fixture(scope="module")
def alice_url(planes: tuple[str, str]) -> Iterator[str]:
    """Tenant alice, an ACL user on every node of the cluster, as `lmq tenant add` makes it."""
    admin = sync_redis(planes[0])
    tenants = TenantAdmin(admin, planes[0])
    yield tenants.add(TenantConfig("alice"), password="pw-alice")
    tenants.remove("alice")
    admin.close()


@pytest.fixture(scope="module")
def schedulers(
    planes: tuple[str, str], alice_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[SchedulerProcess]]:
    """A worker on the cluster and two scheduler processes (data: cluster, control: single)."""
    data_url, control_url = planes
    log_dir = tmp_path_factory.mktemp("sched-cluster")
    worker = WorkerProcess(
        MODEL, "mock", data_url, "mock-c", backend_opts={"batch_delay_s": 0.02}, log_dir=log_dir
    ).start()
    config = log_dir / "scheduler.json"
    settings = {
        "control_url": control_url,
        "tenant_urls": {"alice": alice_url},
        "kinds": {kind: kind for kind in KINDS},
        "poll_delay_s": 0.1,
        "lease_s": 6.0,
    }
    config.write_text(json.dumps(settings))
    processes = [
        SchedulerProcess(data_url, f"csched-{i}", config, log_dir).start() for i in range(2)
    ]
    data = sync_redis(data_url)  # submissions are checked on the kinds and the model published
    deadline = time.monotonic() + 120
    while not (
        data.exists(KeySpace().experiment_kinds()) and data.exists(KeySpace().model_info(MODEL))
    ):
        assert time.monotonic() < deadline, worker.log() + processes[0].log()
        time.sleep(0.2)
    data.close()
    yield processes
    for process in processes:
        process.stop()
        assert "Traceback" not in process.log(), process.log()
    assert worker.stop() == 0, worker.log()


@pytest.fixture
async def alice(alice_url: str, schedulers: list[SchedulerProcess]) -> AsyncIterator[Experiments]:
    async with Experiments.connect(alice_url) as client:
        yield client


def test_the_two_tenants_inboxes_are_read_in_separate_slot_groups() -> None:
    """What makes the per-slot reads necessary here (a single XREADGROUP would be CROSSSLOT)."""
    inboxes = [KeySpace(tenant=t).experiment_inbox() for t in ("default", "alice")]
    assert len({LocalCluster.slot_of(key) for key in inboxes}) == 2


async def test_a_tenant_scores_on_the_cluster_and_reads_its_results(
    alice: Experiments, smol_tokenizer: Any
) -> None:
    rows = [{"context": "The capital of France is", "continuation": " Paris"}] * 3
    exp_id = await alice.submit("score", {"rows": rows, "batch_size": 2}, model=MODEL)
    status = await alice.wait(exp_id, 90)
    assert (status.status, status.done, status.total, status.attempts) == ("complete", 3, 3, 1)
    reference = MockAsyncLM(smol_tokenizer)
    ctx = smol_tokenizer.encode(rows[0]["context"], add_special_tokens=False)
    cont = smol_tokenizer.encode(rows[0]["continuation"], add_special_tokens=False)
    expected = [float(reference.logprobs_of(ctx + cont[:i])[t]) for i, t in enumerate(cont)]
    results = await alice.results(exp_id)
    assert [r["index"] for r in results] == [0, 1, 2]
    for result in results:
        assert result["token_logprobs"] == pytest.approx(expected, abs=1e-6)


async def test_arq_and_the_leases_live_on_the_control_instance_only(
    planes: tuple[str, str], schedulers: list[SchedulerProcess]
) -> None:
    data_url, control_url = planes
    async with Experiments.connect(data_url) as default:
        exp_id = await default.submit("exp_kinds:count", {"n": 2, "delay_s": 0})
        assert (await default.wait(exp_id, 30)).status == "complete"
        assert await default.results(exp_id) == [{"index": 0}, {"index": 1}]
    control = redis.Redis.from_url(control_url)
    data = sync_redis(data_url)
    try:
        job = "arq:result:" + KeySpace().experiment_job_id(exp_id)
        assert control.exists(job)
        assert not control.keys("lmq:default:exp:*")  # the tenant's keys are not here
        on_data = data.keys("*", target_nodes=data.PRIMARIES)
        assert not [k for k in on_data if k.startswith((b"arq:", b"lmq:_sched:"))], on_data
        assert data.exists(KeySpace().experiment_record(exp_id))
    finally:
        control.close()
        data.close()


async def test_sigterm_hands_a_running_experiment_over_on_the_cluster(
    alice: Experiments, planes: tuple[str, str], schedulers: list[SchedulerProcess]
) -> None:
    """The hand-over rewrites the record with a one-key script (no MULTI on a cluster)."""
    exp_id = await alice.submit("exp_kinds:count", {"n": 20, "delay_s": 0.1})
    async for status in alice.follow(exp_id, 0.05):
        if status.done >= 3:
            break
    admin = sync_redis(planes[0])  # the record's "scheduler" field is not alice's to read
    owner = admin.hget(alice.keys.experiment_record(exp_id), "scheduler")
    admin.close()
    index = next(i for i, p in enumerate(schedulers) if p.name == owner.decode())
    stopped = schedulers[index]
    assert stopped.stop() == 0, stopped.log()
    assert "will be run again" in stopped.log()
    schedulers[index] = SchedulerProcess(
        planes[0], f"{stopped.name}-b", Path(stopped.args[-1]), stopped.log_path.parent
    ).start()
    status = await alice.wait(exp_id, 60)
    assert (status.status, status.attempts, status.done) == ("complete", 1, 20)
    assert await alice.results(exp_id) == [{"index": i} for i in range(20)]


def test_lmq_experiment_reads_results_from_the_cluster(
    planes: tuple[str, str], schedulers: list[SchedulerProcess], capsys: Any
) -> None:
    from lmqueue.cli import main

    data_url = planes[0]
    exp_id = f"cli-{time.monotonic_ns()}"
    argv = ["experiment", "submit", "exp_kinds:count", "--set", "n=3", "--set", "delay_s=0"]
    assert main([*argv, "--id", exp_id, "--redis-url", data_url]) == 0
    assert main(["experiment", "status", exp_id, "--follow", "--redis-url", data_url]) == 0
    capsys.readouterr()
    assert main(["experiment", "results", exp_id, "--redis-url", data_url]) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == [
        {"index": i} for i in range(3)
    ]


def test_a_cluster_data_url_needs_a_single_instance_control_url(
    planes: tuple[str, str], capsys: Any
) -> None:
    data_url = planes[0]
    assert scheduler_main(["--redis-url", data_url]) == 2
    err = capsys.readouterr().err
    assert "SettingsError" in err and "--control-url" in err and "LMQ_CONTROL_URL" in err
    assert scheduler_main(["--redis-url", data_url, "--control-url", data_url]) == 2
    assert "--control-url" in capsys.readouterr().err
