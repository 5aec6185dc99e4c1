"""The experiment scheduler end to end: real scheduler processes, a real redis-server, real
mock-backend worker processes; each result is checked against a direct in-process computation.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path

import msgpack
import pytest
import redis
import torch

from lmqueue.devstack import LocalRedis, WorkerProcess
from lmqueue.producer import Experiments
from lmqueue.scheduler.kinds.regex_constraint import RegexConstraint
from lmqueue.scheduler.kinds.sample import draw_samples
from lmqueue.scheduler.smc_sampler import lipogram_mask, run_smc
from lmqueue.shared.errors import (
    BadRequest,
    Forbidden,
    Unavailable,
    UnknownAdapter,
    UnknownExperiment,
    UnknownModel,
)
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.lm.trie import TokenCharacterTrie
from lmqueue.shared.tenants import TenantConfig
from lmqueue.tenant_admin import TenantAdmin
from lmqueue.workers.backends.mock import MockAsyncLM
from scheduler_processes import SchedulerProcess

MODEL = "smollm2-135m"
KINDS = ("exp_kinds:count", "exp_kinds:slow_model", "exp_kinds:echo")
TENANTS = ("alice", "bob")


def _tenant_url(url: str, tenant: str) -> str:
    return url.replace("redis://", f"redis://{tenant}:pw-{tenant}@")


@pytest.fixture(scope="module")
def server():
    with LocalRedis() as local:
        admin = redis.Redis.from_url(local.url)
        tenants = TenantAdmin(admin, local.url)
        for tenant in TENANTS:  # real tenants, as `lmq tenant add` makes them (known passwords)
            tenants.add(TenantConfig(tenant))
            admin.execute_command("ACL", "SETUSER", tenant, "resetpass", f">pw-{tenant}")
        admin.close()
        yield local


@pytest.fixture(scope="module")
def url(server):
    return server.url


@pytest.fixture(scope="module")
def worker(url, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("sched-worker")
    process = WorkerProcess(
        MODEL, "mock", url, "mock-0", backend_opts={"batch_delay_s": 0.02}, log_dir=log_dir
    ).start()
    admin = redis.Redis.from_url(url)
    deadline = time.monotonic() + 120
    while not admin.exists(KeySpace().model_info(MODEL)):  # submissions check it is published
        assert time.monotonic() < deadline and process.alive, process.log()
        time.sleep(0.2)
    admin.close()
    yield process
    assert process.stop() == 0, process.log()


@pytest.fixture(scope="module")
def schedulers(url, worker, tmp_path_factory):
    """Two scheduler processes (the kill -9 test replaces the one it kills)."""
    log_dir = tmp_path_factory.mktemp("sched-logs")
    config = log_dir / "scheduler.json"
    config.write_text(
        json.dumps(
            {
                "tenant_urls": {t: _tenant_url(url, t) for t in TENANTS},
                "kinds": {kind: kind for kind in KINDS},
                "max_running_per_tenant": 2,
                "lease_s": 6.0,
                "poll_delay_s": 0.1,
                "limit_retry_s": 0.3,
                "cron": [
                    {
                        "name": "tick",
                        "tenant": "bob",
                        "kind": "exp_kinds:count",
                        "params": {"n": 1, "delay_s": 0},
                        "second": list(range(0, 60, 3)),
                    }
                ],
            }
        )
    )
    processes = [SchedulerProcess(url, f"sched-{i}", config, log_dir).start() for i in range(2)]
    _wait_for_the_kinds(url)
    yield processes
    for process in processes:
        process.stop()
        assert "Traceback" not in process.log(), process.log()


def _wait_for_the_kinds(url: str, timeout_s: float = 60) -> None:
    """Until a scheduler has published the kinds it runs (submissions are checked on them)."""
    admin = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout_s
    while not admin.exists(KeySpace().experiment_kinds()):
        assert time.monotonic() < deadline, "no scheduler published its kinds"
        time.sleep(0.1)
    admin.close()


@pytest.fixture(scope="module")
def reference(smol_tokenizer):
    return MockAsyncLM(smol_tokenizer)


@pytest.fixture
async def experiments(url, schedulers):
    async with Experiments.connect(url) as client:
        yield client


def _unique(name: str) -> str:
    return f"{name}-{time.monotonic_ns()}"


async def test_score_matches_in_process_log_probabilities(experiments, reference, smol_tokenizer):
    rows = [
        {"context": "The capital of France is", "continuation": " Paris"},
        {"context": "Once upon a time", "continuation": " there was a cat."},
        {"context": "", "continuation": "Hello world"},
    ] * 3
    exp_id = await experiments.submit("score", {"rows": rows, "batch_size": 4}, model=MODEL)
    status = await experiments.wait(exp_id, 90)
    assert status.status == "complete", status
    assert (status.done, status.total, status.attempts) == (9, 9, 1)
    results = await experiments.results(exp_id)
    assert [r["index"] for r in results] == list(range(9))
    for row, result in zip(rows, results, strict=True):
        ctx = smol_tokenizer.encode(row["context"], add_special_tokens=False)
        ctx = ctx or [smol_tokenizer.bos_token_id or smol_tokenizer.eos_token_id]
        cont = smol_tokenizer.encode(row["continuation"], add_special_tokens=False)
        expected = [float(reference.logprobs_of(ctx + cont[:i])[t]) for i, t in enumerate(cont)]
        assert result["tokens"] == cont
        assert result["token_logprobs"] == pytest.approx(expected, abs=1e-6)
        assert result["logprob"] == pytest.approx(sum(expected), abs=1e-5)


async def test_a_tenants_experiment_calls_the_model_as_that_tenant(
    url, schedulers, reference, smol_tokenizer
):
    """alice's experiment runs through alice's request stream (fair share and quotas apply)."""
    rows = [{"context": "The capital of France is", "continuation": " Paris"}] * 2
    admin = redis.asyncio.Redis.from_url(url)
    try:
        async with Experiments.connect(_tenant_url(url, "alice")) as alice:
            exp_id = await alice.submit("score", {"rows": rows}, model=MODEL)
            status = await alice.wait(exp_id, 90)
            assert status.status == "complete", status
            results = await alice.results(exp_id)
        ctx = smol_tokenizer.encode(rows[0]["context"], add_special_tokens=False)
        cont = smol_tokenizer.encode(rows[0]["continuation"], add_special_tokens=False)
        expected = [float(reference.logprobs_of(ctx + cont[:i])[t]) for i, t in enumerate(cont)]
        for result in results:
            assert result["token_logprobs"] == pytest.approx(expected, abs=1e-6)
        # the calls went through alice's keys: her request stream's group delivered them
        groups = await admin.xinfo_groups(KeySpace(tenant="alice").requests(MODEL))
        assert groups and groups[0]["entries-read"] >= len(cont)
    finally:
        await admin.aclose()


async def test_sample_matches_in_process_sampling(experiments, reference, smol_tokenizer):
    params = {"prompt": "Tell me", "n": 5, "max_tokens": 6, "temperature": 0.8, "seed": 3}
    exp_id = await experiments.submit("sample", {**params, "batch_size": 2}, model=MODEL)
    assert (await experiments.wait(exp_id, 90)).status == "complete"
    results = await experiments.results(exp_id)
    prompt = smol_tokenizer.encode("Tell me", add_special_tokens=False)
    expected = await draw_samples(
        reference, prompt, range(5), max_tokens=6, temperature=0.8, seed=3,
        eos_token_ids=[smol_tokenizer.eos_token_id],
    )  # fmt: skip
    assert [r["tokens"] for r in results] == [e["tokens"] for e in expected]
    for result in results:  # the reported log-probability is the model's, token by token
        steps = [reference.logprobs_of(prompt + result["tokens"][:i]) for i in range(6)]
        total = sum(float(v[t]) for v, t in zip(steps, result["tokens"], strict=False))
        assert result["logprob"] == pytest.approx(total, abs=1e-4)
    assert len({tuple(r["tokens"]) for r in results}) > 1


async def test_smc_with_a_lipogram_and_a_regex_matches_in_process_runs(
    experiments, reference, smol_tokenizer
):
    prompt_text = "Write a number"
    prompt = smol_tokenizer.encode(prompt_text, add_special_tokens=False)
    base = {"prompt": prompt_text, "particles": 6, "steps": 5, "seed": 1}
    lipogram = await experiments.submit("smc", {**base, "lipogram": "eE"}, model=MODEL)
    pattern = "[0-9]+( [0-9]+)*"
    regex = await experiments.submit("smc", {**base, "regex": pattern}, model=MODEL)
    vocab = [bytes(t) for t in reference.byte_vocab]
    eos = [smol_tokenizer.eos_token_id]

    expected = await run_smc(
        reference, prompt, 6, 5, allowed=lipogram_mask(vocab), eos_token_ids=eos, seed=1
    )
    assert (await experiments.wait(lipogram, 90)).status == "complete"
    rows = await experiments.results(lipogram)
    assert [r["tokens"] for r in rows] == [p.tokens for p in expected.particles]
    assert [r["log_weight"] for r in rows] == pytest.approx(
        [p.log_weight if math.isfinite(p.log_weight) else None for p in expected.particles],
        abs=1e-4,
    )
    assert all("e" not in r["text"].lower() for r in rows)

    constraint = RegexConstraint(pattern, TokenCharacterTrie(vocab), eos)
    expected = await run_smc(
        reference, prompt, 6, 5, allowed_for=constraint.allowed_for, eos_token_ids=eos, seed=1
    )
    assert (await experiments.wait(regex, 90)).status == "complete"
    rows = await experiments.results(regex)
    assert [r["tokens"] for r in rows] == [p.tokens for p in expected.particles]
    assert all(r["tokens"] for r in rows)
    for row in rows:
        assert constraint.viable(b"".join(vocab[t] for t in row["tokens"])), row["text"]


async def test_the_same_id_submitted_twice_runs_once(experiments):
    exp_id = _unique("twice")
    first = experiments.submit("exp_kinds:count", {"n": 3, "delay_s": 0.05}, experiment_id=exp_id)
    second = experiments.submit("exp_kinds:count", {"n": 7, "delay_s": 0.05}, experiment_id=exp_id)
    assert await asyncio.gather(first, second) == [exp_id, exp_id]
    assert await experiments.submit("exp_kinds:count", {"n": 9}, experiment_id=exp_id) == exp_id
    status = await experiments.wait(exp_id, 30)
    assert (status.status, status.attempts, status.total) == ("complete", 1, 3)
    assert await experiments.results(exp_id) == [{"index": i} for i in range(3)]
    assert [s.id for s in await experiments.list()].count(exp_id) == 1


async def test_a_submission_an_outage_cut_short_is_completed_by_its_retry_and_by_no_other(
    experiments, monkeypatch
):
    import redis.asyncio as aioredis

    exp_id = _unique("cut")
    params = {"n": 2, "delay_s": 0}

    def cut(*args, **kwargs):
        raise redis.exceptions.ConnectionError("Connection closed by server.")

    with monkeypatch.context() as patch:  # the connection goes after the id is claimed
        patch.setattr(aioredis.Redis, "pipeline", cut)
        with pytest.raises(Unavailable):
            await experiments.submit("exp_kinds:count", params, experiment_id=exp_id)
    # another submission of the id does not take it over; the same one again completes it
    assert await experiments.submit("exp_kinds:count", {"n": 9}, experiment_id=exp_id) == exp_id
    assert (await experiments.status(exp_id)).kind == ""  # nothing of the other was written
    assert await experiments.submit("exp_kinds:count", params, experiment_id=exp_id) == exp_id
    status = await experiments.wait(exp_id, 30)
    assert (status.status, status.total, status.attempts) == ("complete", 2, 1)
    assert await experiments.results(exp_id) == [{"index": 0}, {"index": 1}]


async def test_a_deferred_experiment_starts_at_its_time(experiments):
    start = time.time() + 2.0
    exp_id = await experiments.submit(
        "exp_kinds:count", {"n": 1, "delay_s": 0}, start_after_s=start
    )
    await asyncio.sleep(1.0)
    early = await experiments.status(exp_id)
    assert (early.status, early.started_ms) == ("queued", 0)
    status = await experiments.wait(exp_id, 30)
    assert status.status == "complete"
    assert status.started_ms >= int(start * 1000)


async def test_cancel_stops_a_running_experiment_and_its_model_calls(experiments):
    exp_id = await experiments.submit("exp_kinds:slow_model", {"width": 16}, model=MODEL)
    async for status in experiments.follow(exp_id, 0.1):
        if status.done >= 3:
            break
    asked = time.monotonic()
    await experiments.cancel(exp_id)
    status = await experiments.wait(exp_id, 10)
    assert status.status == "cancelled"
    assert time.monotonic() - asked < 3.0
    record = await experiments.redis.hgetall(experiments.keys.experiment_record(exp_id))
    assert int(record[b"pending_at_cancel"]) > 0  # model calls were awaited when cancelled
    assert int(record[b"inflight_after_cancel"]) == 0  # and their requests were withdrawn
    rows = len(await experiments.results(exp_id))
    await asyncio.sleep(1.0)
    assert len(await experiments.results(exp_id)) == rows
    assert (await experiments.cancel(exp_id)).status == "cancelled"


async def test_a_queued_experiment_cancelled_never_runs(experiments):
    exp_id = await experiments.submit("exp_kinds:count", {"n": 1}, start_after_s=time.time() + 1.5)
    await experiments.cancel(exp_id)
    status = await experiments.wait(exp_id, 30)
    assert (status.status, status.started_ms, status.attempts) == ("cancelled", 0, 0)


async def test_kill_9_mid_score_resumes_from_the_checkpoint_without_duplicates(
    experiments, schedulers, url, reference, smol_tokenizer
):
    rows = [{"context": f"Item {i}:", "continuation": f" value {i * 7} ok"} for i in range(80)]
    exp_id = await experiments.submit("score", {"rows": rows, "batch_size": 2}, model=MODEL)
    async for status in experiments.follow(exp_id, 0.05):
        if status.done >= 16:
            break
    owner = await experiments.redis.hget(experiments.keys.experiment_record(exp_id), "scheduler")
    victim = next(i for i, p in enumerate(schedulers) if p.name == owner.decode())
    schedulers[victim].kill()
    killed_at = (await experiments.status(exp_id)).done
    assert 0 < killed_at < 80
    status = await experiments.wait(exp_id, 60)
    schedulers[victim] = SchedulerProcess(
        url, f"{schedulers[victim].name}-b", Path(schedulers[victim].args[-1]),
        schedulers[victim].log_path.parent,
    ).start()  # fmt: skip
    assert (status.status, status.attempts, status.done) == ("complete", 2, 80)
    results = await experiments.results(exp_id)
    assert [r["index"] for r in results] == list(range(80))  # none missing, none twice
    for row, result in zip(rows, results, strict=True):
        ctx = smol_tokenizer.encode(row["context"], add_special_tokens=False)
        cont = smol_tokenizer.encode(row["continuation"], add_special_tokens=False)
        expected = [float(reference.logprobs_of(ctx + cont[:i])[t]) for i, t in enumerate(cont)]
        assert result["token_logprobs"] == pytest.approx(expected, abs=1e-6)


async def test_a_scheduler_stopped_with_sigterm_hands_its_experiment_to_another(
    experiments, schedulers, url
):
    exp_id = await experiments.submit("exp_kinds:count", {"n": 30, "delay_s": 0.1})
    async for status in experiments.follow(exp_id, 0.05):
        if status.done >= 5:
            break
    owner = await experiments.redis.hget(experiments.keys.experiment_record(exp_id), "scheduler")
    index = next(i for i, p in enumerate(schedulers) if p.name == owner.decode())
    stopped = schedulers[index]
    assert stopped.stop() == 0, stopped.log()
    assert "will be run again" in stopped.log()
    schedulers[index] = SchedulerProcess(
        url, f"{stopped.name}-c", Path(stopped.args[-1]), stopped.log_path.parent
    ).start()
    status = await experiments.wait(exp_id, 30)
    assert (status.status, status.attempts, status.done) == ("complete", 1, 30)  # no crash
    assert await experiments.results(exp_id) == [{"index": i} for i in range(30)]


async def test_a_tenant_runs_at_most_its_limit_at_once_the_rest_wait(experiments):
    ids = [await experiments.submit("exp_kinds:count", {"n": 4, "delay_s": 0.25}) for _ in range(3)]
    waiting_seen = False
    while True:
        statuses = [await experiments.status(i) for i in ids]
        assert sum(s.status == "running" for s in statuses) <= 2
        waiting_seen |= any("tenant limit" in s.waiting for s in statuses)
        if all(s.finished for s in statuses):
            break
        await asyncio.sleep(0.05)
    assert all(s.status == "complete" for s in statuses)
    assert waiting_seen
    spans = sorted((s.started_ms, s.finished_ms) for s in statuses)
    assert spans[2][0] >= min(spans[0][1], spans[1][1])  # the third began after one ended


async def test_tenants_see_and_cancel_only_their_own_experiments(url, schedulers):
    alice_url, bob_url = _tenant_url(url, "alice"), _tenant_url(url, "bob")
    async with Experiments.connect(alice_url) as alice, Experiments.connect(bob_url) as bob:
        assert (alice.tenant, bob.tenant) == ("alice", "bob")
        exp_id = await alice.submit("exp_kinds:count", {"n": 8, "delay_s": 0.1})
        assert exp_id not in [s.id for s in await bob.list()]
        with pytest.raises(UnknownExperiment):
            await bob.status(exp_id)  # bob's own keys have no such experiment
        async with Experiments.connect(bob_url, tenant="alice") as intruder:
            attempts = [
                intruder.status(exp_id),
                intruder.cancel(exp_id),
                intruder.results(exp_id),
                intruder.list(),
                intruder.submit("exp_kinds:count", {"n": 1}),
            ]
            for attempt in attempts:
                with pytest.raises(Forbidden, match="no permissions"):
                    await attempt
        raw = redis.asyncio.Redis.from_url(bob_url)
        try:
            record = KeySpace(tenant="alice").experiment_record(exp_id)
            for command in (
                ("HSET", record, "cancel_requested", "1"),
                ("HGETALL", record),
                ("KEYS", "arq:*"),
                ("ZRANGE", KeySpace(tenant="bob").scheduler_queue(), 0, -1),
                ("ZADD", KeySpace(tenant="bob").experiments_running(), 0, "x"),
            ):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    await raw.execute_command(*command)
        finally:
            await raw.aclose()
        status = await alice.wait(exp_id, 30)
        assert (status.status, status.done, status.cancel_requested) == ("complete", 8, False)
        assert [r["index"] for r in await alice.results(exp_id)] == list(range(8))


async def test_arq_jobs_in_redis_are_msgpack_not_pickle(experiments, url):
    exp_id = await experiments.submit("exp_kinds:count", {"n": 1}, start_after_s=time.time() + 60)
    job_key = f"arq:job:{experiments.keys.experiment_job_id(exp_id)}"
    for _ in range(100):
        raw = await experiments.redis.get(job_key)
        if raw is not None:
            break
        await asyncio.sleep(0.05)
    assert raw is not None and raw[:1] != b"\x80"  # pickle starts with PROTO (0x80)
    job = msgpack.unpackb(raw, raw=False)
    assert (job["f"], job["a"]) == ("run_experiment", ["default", exp_id])
    await experiments.cancel(exp_id)


async def test_an_unknown_kind_is_refused_at_submit_naming_the_kinds_the_schedulers_run(
    experiments,
):
    before = await experiments.redis.xlen(experiments.keys.experiment_inbox())
    with pytest.raises(BadRequest) as caught:
        await experiments.submit("scroe", {}, model=MODEL, experiment_id="never-queued")
    assert "unknown experiment kind 'scroe'" in caught.value.message
    assert "score" in caught.value.message and "exp_kinds:count" in caught.value.message
    assert await experiments.redis.xlen(experiments.keys.experiment_inbox()) == before
    assert not await experiments.redis.exists(experiments.keys.experiment_record("never-queued"))


@pytest.mark.parametrize(
    ("kind", "params", "model", "error", "says"),
    [
        ("sample", {"prompt": "hi", "n": "abc"}, MODEL, BadRequest, "n='abc' is not of type int"),
        ("sample", {"prompt": "hi", "nn": 3}, MODEL, BadRequest, "takes no parameter nn"),
        ("score", {}, MODEL, BadRequest, "needs parameter rows"),
        ("score", {"rows": []}, "", BadRequest, "calls a model"),
        ("score", {"rows": []}, "no-such-model", UnknownModel, "no-such-model"),
    ],
)
async def test_a_bad_experiment_is_refused_at_submit_with_nothing_queued(
    experiments, kind, params, model, error, says
):
    before = await experiments.redis.xlen(experiments.keys.experiment_inbox())
    with pytest.raises(error) as caught:
        await experiments.submit(kind, params, model=model)
    assert says in caught.value.message
    assert await experiments.redis.xlen(experiments.keys.experiment_inbox()) == before


def test_the_command_refuses_a_bad_experiment_with_exit_2_naming_the_cause(
    url, schedulers, tmp_path, capsys
):
    from lmqueue.cli import main

    cases = [
        (["scroe", "--model", MODEL], "unknown experiment kind 'scroe'"),
        (["sample", "--model", MODEL, "--set", "prompt=hi", "--set", "n=abc"], "n='abc'"),
        (["score", "--model", MODEL, "--data", str(tmp_path / "missing.jsonl")],
         f"cannot read {tmp_path / 'missing.jsonl'}"),
        (["score", "--model", "nobody-serves", "--set", "rows=[]"],
         "models served here: smollm2-135m"),
    ]  # fmt: skip
    for args, says in cases:
        code = main(["experiment", "submit", *args, "--redis-url", url])
        out, err = capsys.readouterr()
        assert code == 2 and out == "" and says in err, (args, err)


async def test_a_deferred_experiment_cancelled_reads_cancelled_at_once(experiments):
    exp_id = await experiments.submit("exp_kinds:count", {"n": 1}, start_after_s=time.time() + 60)
    assert (await experiments.status(exp_id)).status == "queued"
    assert (await experiments.cancel(exp_id)).status == "cancelled"
    assert (await experiments.status(exp_id)).status == "cancelled"


async def test_a_failing_experiment_reports_its_error(experiments):
    exp_id = await experiments.submit("score", {"rows": [{"context": 1}]}, model=MODEL)
    status = await experiments.wait(exp_id, 60)
    assert status.status == "failed" and "BadRequest" in status.error


async def test_cron_entries_submit_recurring_experiments(url, schedulers):
    async with Experiments.connect(_tenant_url(url, "bob")) as bob:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            done = [s for s in await bob.list() if s.id.startswith("tick-") and s.finished]
            if len(done) >= 2:
                break
            await asyncio.sleep(0.5)
        assert len(done) >= 2 and all(s.status == "complete" for s in done)
        assert len({s.id for s in done}) == len(done)


def test_lmq_experiment_commands_submit_follow_and_collect(url, schedulers, tmp_path, capsys):
    from lmqueue.cli import main

    data = tmp_path / "rows.jsonl"
    data.write_text(
        "\n".join(json.dumps({"context": "A", "continuation": f" b{i}"}) for i in range(5))
    )
    exp_id = _unique("cli")
    argv = ["experiment", "submit", "score", "--model", MODEL, "--data", str(data)]
    assert main([*argv, "--set", "batch_size=2", "--id", exp_id, "--redis-url", url]) == 0
    assert capsys.readouterr().out.strip() == exp_id
    assert main(["experiment", "status", exp_id, "--follow", "--redis-url", url]) == 0
    captured = capsys.readouterr()
    assert "5/5" in captured.err and "complete" in captured.out  # the bar, then the status line
    out = tmp_path / "results.jsonl"
    assert main(["experiment", "results", exp_id, "-o", str(out), "--redis-url", url]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["continuation"] for r in rows] == [f" b{i}" for i in range(5)]
    assert main(["experiment", "list", "--redis-url", url]) == 0
    assert exp_id in capsys.readouterr().out
    assert main(["experiment", "status", "no-such-id", "--redis-url", url]) == 2
    assert "UnknownExperiment" in capsys.readouterr().err


@pytest.mark.slow
async def test_score_with_the_smollm2_worker_matches_in_process_logprobs(tmp_path):
    """The real SmolLM2-135M: scores through the queue equal a direct forward pass (1e-4)."""
    from lmqueue.workers.models import load_causal_lm, load_tokenizer

    rows = [
        {"context": "The capital of France is", "continuation": " Paris."},
        {"context": "def add(a, b):", "continuation": "\n    return a + b"},
        {"context": "Roses are red,", "continuation": " violets are blue."},
    ]
    with LocalRedis() as local:
        worker = WorkerProcess(MODEL, "hf", local.url, "hf-0", log_dir=tmp_path).start()
        config = tmp_path / "scheduler.json"
        config.write_text("{}")
        process = SchedulerProcess(local.url, "sched-hf", config, tmp_path).start()
        try:
            admin = redis.Redis.from_url(local.url)
            deadline = time.monotonic() + 300  # submissions check that the model is published
            while not admin.exists(KeySpace().model_info(MODEL)):
                assert time.monotonic() < deadline and worker.alive, worker.log()
                await asyncio.sleep(0.5)
            admin.close()
            async with Experiments.connect(local.url) as experiments:
                exp_id = await experiments.submit("score", {"rows": rows}, model=MODEL)
                status = await experiments.wait(exp_id, 300)
                assert status.status == "complete", (status, process.log())
                results = await experiments.results(exp_id)
        finally:
            process.stop()
            assert worker.stop() == 0, worker.log()
    tokenizer, model = load_tokenizer(MODEL), load_causal_lm(MODEL).eval()
    for row, result in zip(rows, results, strict=True):
        ctx = tokenizer.encode(row["context"], add_special_tokens=False)
        cont = tokenizer.encode(row["continuation"], add_special_tokens=False)
        with torch.no_grad():
            logits = model(torch.tensor([ctx + cont])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        expected = [float(logprobs[len(ctx) - 1 + i, t]) for i, t in enumerate(cont)]
        assert result["token_logprobs"] == pytest.approx(expected, abs=1e-4)


async def test_an_experiment_with_an_adapter_parameter_calls_that_adapter(
    experiments, url, smol_tokenizer, tmp_path
):
    from test_adapters import _retry_unknown, fake_adapter

    from lmqueue.shared.adapters import AdapterRecord, AdapterRegistry, adapter_revision

    path = fake_adapter(tmp_path / "exp-a", b"experiment adapter")
    admin = redis.asyncio.Redis.from_url(url)
    try:
        record = AdapterRecord("exp-a", str(path), adapter_revision(path))
        await AdapterRegistry(admin, KeySpace(), MODEL).add(record)
    finally:
        await admin.aclose()
    tuned = MockAsyncLM(smol_tokenizer)
    await tuned.load_adapter("exp-a", str(path))
    rows = [{"context": "The capital of France is", "continuation": " Paris"}]

    async def scored() -> dict:
        exp_id = await experiments.submit("score", {"rows": rows}, model=MODEL, adapter="exp-a")
        status = await experiments.wait(exp_id, 60)
        if status.status == "failed" and "UnknownAdapter" in status.error:
            raise UnknownAdapter(status.error)  # the worker has not loaded it yet: again
        assert status.status == "complete", status
        return (await experiments.results(exp_id))[0]

    result = await _retry_unknown(scored, timeout_s=20)
    ctx = smol_tokenizer.encode(rows[0]["context"], add_special_tokens=False)
    cont = result["tokens"]
    expected = [float(tuned.logprobs_of(ctx + cont[:i], "exp-a")[t]) for i, t in enumerate(cont)]
    assert result["token_logprobs"] == pytest.approx(expected, abs=1e-6)
    exp_id = await experiments.submit("score", {"rows": rows, "adapter": "nope"}, model=MODEL)
    status = await experiments.wait(exp_id, 60)
    assert status.status == "failed" and "UnknownAdapter" in status.error
