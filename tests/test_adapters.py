"""LoRA adapters by name through the whole path, on the deterministic mock backend.

The mock perturbs each adapter's rows by noise seeded by the adapter directory's files, so
these tests check the plumbing (wire, registry, worker checks, every cache and de-duplication
keyed on the adapter) in milliseconds; tests/test_adapters_hf.py checks real PEFT forwards.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from lmqueue.producer import QueueLM
from lmqueue.shared.adapters import (
    AdapterRecord,
    AdapterRegistry,
    adapter_revision,
    check_adapter,
    parse_adapter_spec,
)
from lmqueue.shared.errors import (
    AdaptersUnsupported,
    Forbidden,
    InvalidName,
    MalformedMessage,
    SettingsError,
    UnknownAdapter,
)
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.partitions import Partitioning
from lmqueue.shared.prompt_key import PromptKey
from lmqueue.shared.settings import RedisSettings, WorkerSettings
from lmqueue.shared.wire import Request, decode_reply, decode_request, encode_request, ids_to_bytes
from lmqueue.workers.backends.mock import MockAsyncLM
from lmqueue.workers.backends.prefix_cache import PrefixCache
from lmqueue.workers.worker import Worker
from workers_in_threads import ThreadedWorker

KEYS = KeySpace()
PROMPT = [1, 2, 3, 4]


def fake_adapter(directory: Path, content: bytes) -> Path:
    """A directory the mock accepts as an adapter: its files' digest seeds its perturbation."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (directory / "adapter_model.safetensors").write_bytes(content)
    return directory


@pytest.fixture
def adapter_dirs(tmp_path):
    return {name: str(fake_adapter(tmp_path / name, name.encode() * 8)) for name in ("a", "b")}


@pytest.fixture
def backend(smol_tokenizer):
    return MockAsyncLM(smol_tokenizer)


@pytest.fixture
def worker(backend, redis_url, adapter_dirs):
    served = ThreadedWorker(backend, redis_url, adapters=adapter_dirs).start()
    yield served
    served.stop()


# -- names, records, wire ------------------------------------------------------------------------
def _read(request: Request) -> Request:
    """`request` encoded, then decoded as a reader gets it from Redis (bytes field names)."""
    return decode_request({k.encode(): v for k, v in encode_request(request).items()})


def test_an_adapter_travels_in_the_request_and_is_absent_for_the_base_model():
    base = Request("r1", "c1", ids_to_bytes(PROMPT))
    tuned = Request("r2", "c1", ids_to_bytes(PROMPT), adapter="style-1.2_x")
    assert _read(base).adapter is None
    assert _read(tuned).adapter == "style-1.2_x"
    assert b"adapter" not in encode_request(base)["m"]


@pytest.mark.parametrize("name", ["", "a" * 65, "a b", "a:b", "a{b}", "é", "a*"])
def test_the_wire_refuses_adapter_names_outside_the_allowed_shape(name):
    with pytest.raises(MalformedMessage) as caught:
        _read(Request("r1", "c1", ids_to_bytes(PROMPT), adapter=name))
    assert caught.value.data == {"request_id": "r1", "client_id": "c1"}


def test_adapter_specs_and_names_are_validated():
    assert parse_adapter_spec("style=/x/y=z") == ("style", "/x/y=z")
    for spec in ("style", "=path", "a b=/p", "style="):
        with pytest.raises(InvalidName):
            parse_adapter_spec(spec)
    with pytest.raises(SettingsError, match="adapter name"):
        WorkerSettings(model="m", adapters={"bad name": "/p"})


def test_records_round_trip_and_access_follows_the_tenant():
    public = AdapterRecord("pub", "/p", "r1")
    private = AdapterRecord("mine", "/q", "r2", tenant="alice")
    assert AdapterRecord.from_bytes("mine", private.to_bytes()) == private
    records = {"pub": public, "mine": private}
    assert check_adapter(records, None, "bob") is None
    assert check_adapter(records, "mine", "alice") == private
    with pytest.raises(Forbidden):
        check_adapter(records, "mine", "bob")
    with pytest.raises(UnknownAdapter) as caught:
        check_adapter(records, "nope", "bob")
    assert caught.value.data["served"] == ["pub"]  # never another tenant's private name


def test_an_adapters_revision_follows_its_files_and_needs_a_peft_directory(tmp_path):
    one = adapter_revision(fake_adapter(tmp_path / "one", b"x"))
    assert one == adapter_revision(fake_adapter(tmp_path / "same", b"x"))
    assert one != adapter_revision(fake_adapter(tmp_path / "other", b"y"))
    with pytest.raises(FileNotFoundError):
        adapter_revision(tmp_path)


# -- every key carries the adapter -----------------------------------------------------------------
def test_cache_keys_carry_adapter_and_revision_and_private_rows_skip_the_pool():
    keys = KeySpace(tenant="alice", cache_namespace="pool.lab")
    token_bytes = ids_to_bytes(PROMPT)
    base = keys.cache_entry("m", "rev", "lp.float32", token_bytes)
    public = keys.cache_entry("m", "rev", "lp.float32", token_bytes, adapter_tag="a@1")
    newer = keys.cache_entry("m", "rev", "lp.float32", token_bytes, adapter_tag="a@2")
    private = keys.cache_entry(
        "m", "rev", "lp.float32", token_bytes, adapter_tag="a@1", own_namespace=True
    )
    assert len({base, public, newer, private}) == 4
    assert base.startswith("lmq:pool.lab:cache:") and public.startswith("lmq:pool.lab:cache:")
    assert private.startswith("lmq:alice:cache:")


def test_partition_choice_depends_on_the_adapter():
    prompts = [[n, n + 1, n + 2] for n in range(200)]
    base = [Partitioning(16).of(PromptKey.of_ids(p)) for p in prompts]
    tuned = [Partitioning(16).of(PromptKey.of_ids(p, "style")) for p in prompts]
    assert base == [Partitioning(16).of(PromptKey.of_ids(p)) for p in prompts]  # deterministic
    assert sum(a != b for a, b in zip(base, tuned, strict=True)) > 150


def test_the_prefix_trie_keeps_each_adapters_results_and_kv_apart():
    import numpy as np
    import torch

    from lmqueue.workers.backends.kv_pool import KvPool

    cache = PrefixCache(10, KvPool(100, (2, 1, 4), torch.float32, "cpu"))
    base, tuned = cache.reserve(3), cache.reserve(3)
    cache.insert((1, 2, 3), torch.tensor([0.0]), 0, base)
    cache.insert((1, 2, 3), torch.tensor([1.0]), 0, tuned, adapter="a")
    assert cache.get((1, 2, 3)).item() == 0.0
    assert cache.get((1, 2, 3), "a").item() == 1.0
    assert cache.get((1, 2, 3), "b") is None
    slots, covered = cache.kv_prefix((1, 2, 3, 4), 3, "b")
    assert covered == 0 and len(slots) == 0
    slots, covered = cache.kv_prefix((1, 2, 3, 4), 3, "a")
    assert covered == 3 and np.array_equal(slots, tuned)
    cache._check_invariants()
    cache.drop_adapter("a")
    assert cache.get((1, 2, 3), "a") is None and cache.kv_tokens == 3
    assert cache.num_results == 1 and cache.pool.free_slots == 97
    cache._check_invariants()


# -- through the queue -----------------------------------------------------------------------------
async def test_base_and_two_adapters_give_three_rows_each_its_own_in_one_batch_and_from_cache(
    worker, redis_url, backend
):
    names = [None, "a", "b"]
    async with await QueueLM.connect("mock", redis_url=redis_url, timeout_s=20) as lm:
        rows = await asyncio.gather(
            *(lm.next_token_logprobs(PROMPT, lora_name=n) for n in names * 3)
        )
        assert lm.stats["sent"] == 3  # identical calls joined per adapter, never across
    for n, row in zip(names * 3, rows, strict=True):
        np.testing.assert_array_equal(row.numpy(), backend.logprobs_of(PROMPT, n).numpy())
    assert min((rows[i] - rows[j]).abs().max() for i, j in ((0, 1), (0, 2), (1, 2))) > 0.1
    assert max(backend.batch_sizes) == 3  # all three interleaved in one batch
    async with await QueueLM.connect("mock", redis_url=redis_url, timeout_s=20) as again:
        cached = [await again.next_token_logprobs(PROMPT, lora_name=n) for n in names]
        assert again.stats["cache_hits"] == 3 and again.stats["sent"] == 0
    for before, after in zip(rows[:3], cached, strict=True):
        np.testing.assert_array_equal(before.numpy(), after.numpy())


async def test_a_client_bound_to_an_adapter_asks_for_it_and_its_local_cache_keeps_them_apart(
    worker, redis_url, backend
):
    async with await QueueLM.connect("mock", redis_url=redis_url, adapter="a") as lm:
        assert lm.adapter == "a"
        bound = await lm.next_token_logprobs(PROMPT)
        base_by_name = await lm.next_token_logprobs(PROMPT, lora_name="b")
        again = await lm.next_token_logprobs(PROMPT)
        assert lm.stats["sent"] + lm.stats["cache_hits"] == 2  # the repeat: the local LRU
    np.testing.assert_array_equal(bound.numpy(), backend.logprobs_of(PROMPT, "a").numpy())
    np.testing.assert_array_equal(base_by_name.numpy(), backend.logprobs_of(PROMPT, "b").numpy())
    assert again is bound


async def test_an_unknown_adapter_is_a_typed_error_naming_the_served_ones(worker, redis_url):
    async with await QueueLM.connect("mock", redis_url=redis_url) as lm:
        with pytest.raises(UnknownAdapter) as caught:
            await lm.next_token_logprobs(PROMPT, lora_name="nope")
        assert caught.value.data["served"] == ["a", "b"]
        assert "a, b" in str(caught.value)
    with pytest.raises(UnknownAdapter):
        await QueueLM.connect("mock", redis_url=redis_url, adapter="nope")


async def test_the_worker_itself_refuses_adapters_it_does_not_serve(worker, aredis):
    """A client that skips its checks (writes the stream itself) gets typed errors back."""
    await AdapterRegistry(aredis, KEYS, "mock").add(AdapterRecord("theirs", "/x", "r", "alice"))
    for n, name in enumerate(["nope", "theirs"]):
        request = Request(f"r{n}", "rogue", ids_to_bytes(PROMPT), adapter=name)
        await aredis.xadd(KEYS.requests("mock"), encode_request(request))
    replies = await _wait_replies(aredis, "rogue", 2)
    assert isinstance(replies["r0"].error, UnknownAdapter)
    assert replies["r0"].error.data["served"] == ["a", "b"]  # "theirs" is not loaded here
    assert isinstance(replies["r1"].error, UnknownAdapter | Forbidden)


async def test_an_adapter_added_to_the_registry_is_served_by_running_workers(
    worker, redis_url, aredis, tmp_path, backend
):
    path = fake_adapter(tmp_path / "late", b"late weights")
    record = AdapterRecord("late", str(path), adapter_revision(path))
    async with await QueueLM.connect("mock", redis_url=redis_url, timeout_s=20) as lm:
        await AdapterRegistry(aredis, KEYS, "mock").add(record)
        row = await _retry_unknown(lambda: lm.next_token_logprobs(PROMPT, lora_name="late"))
        np.testing.assert_array_equal(row.numpy(), backend.logprobs_of(PROMPT, "late").numpy())
        await AdapterRegistry(aredis, KEYS, "mock").remove("late")
        deadline = time.monotonic() + 10
        while "late" in backend.adapter_names and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert "late" not in backend.adapter_names


async def test_an_adapter_published_since_the_last_refresh_is_loaded_not_refused(
    smol_tokenizer, redis_url, aredis, tmp_path, monkeypatch
):
    """A worker that reads a request for an adapter a peer published after its last refresh
    reads the registry again before refusing (found by ``lmq bench soak``: a worker started
    beside one with ``--adapter`` refused its adapters' requests for seconds)."""
    from lmqueue.workers import upkeep

    monkeypatch.setattr(upkeep, "TENANT_REFRESH_S", 3600.0)  # no refresh comes to the rescue
    backend = MockAsyncLM(smol_tokenizer)
    served = ThreadedWorker(backend, redis_url).start()
    try:
        path = fake_adapter(tmp_path / "peer", b"a peer's weights")
        await _wait_serving(served)  # its last read of the registry is before the record
        record = AdapterRecord("peer", str(path), adapter_revision(path))
        await AdapterRegistry(aredis, KEYS, "mock").add(record)
        assert "peer" not in backend.adapter_names
        async with await QueueLM.connect("mock", redis_url=redis_url, timeout_s=20) as lm:
            row = await lm.next_token_logprobs(PROMPT, lora_name="peer")
            expected = backend.logprobs_of(PROMPT, "peer").numpy()
            np.testing.assert_array_equal(row.numpy(), expected)
            with pytest.raises(UnknownAdapter):  # a name nobody publishes is still refused
                await _raw_request(aredis, "nope")
    finally:
        served.stop()


async def _wait_serving(served: ThreadedWorker, timeout_s: float = 30) -> None:
    """Until the worker's serve loop has published (again) and started its upkeep."""
    deadline = time.monotonic() + timeout_s
    while not served.worker.health.serving:
        assert time.monotonic() < deadline, "the worker did not start serving"
        await asyncio.sleep(0.05)


async def _raw_request(aredis, adapter: str) -> None:
    """Send one request naming `adapter` past the client's checks; raise its reply's error."""
    request = Request("raw-0", "raw", ids_to_bytes(PROMPT), adapter=adapter)
    await aredis.xadd(KEYS.requests("mock"), encode_request(request))
    reply = (await _wait_replies(aredis, "raw", 1))["raw-0"]
    if reply.error is not None:
        raise reply.error


async def test_a_record_whose_files_changed_is_not_served(worker, aredis, tmp_path, backend):
    path = fake_adapter(tmp_path / "moved", b"new weights")
    await AdapterRegistry(aredis, KEYS, "mock").add(AdapterRecord("moved", str(path), "0" * 16))
    await asyncio.sleep(2 * 2.0 + 0.5)  # two tenant refreshes
    assert "moved" not in backend.adapter_names


async def test_a_backend_without_adapters_refuses_them_at_start(smol_tokenizer, redis_url, aredis):
    class BaseOnly(MockAsyncLM):
        supports_adapters = False

    settings = WorkerSettings(
        model="mock", backend="mock", redis=RedisSettings(url=redis_url), adapters={"a": "/p"}
    )
    with pytest.raises(AdaptersUnsupported, match="cannot serve LoRA adapters"):
        Worker(settings, BaseOnly(smol_tokenizer), aredis)


async def test_a_missing_adapter_directory_stops_the_worker_with_its_name(
    smol_tokenizer, redis_url, aredis, tmp_path
):
    settings = WorkerSettings(
        model="mock", backend="mock", redis=RedisSettings(url=redis_url),
        adapters={"gone": str(tmp_path / "gone")},
    )  # fmt: skip
    worker = Worker(settings, MockAsyncLM(smol_tokenizer), aredis)
    with pytest.raises(SettingsError, match="--adapter gone="):
        await worker.publish()


async def _wait_replies(aredis, client: str, count: int, keys: KeySpace = KEYS) -> dict:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        entries = await aredis.xrange(keys.replies(client))
        if len(entries) >= count:
            return {r.request_id: r for r in (decode_reply(f) for _, f in entries)}
        await asyncio.sleep(0.05)
    raise AssertionError(f"fewer than {count} replies")


async def _retry_unknown(call, timeout_s: float = 10.0):
    """`call()` until the adapter it names is served (workers load it within seconds)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await call()
        except UnknownAdapter:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


def test_the_worker_command_line_takes_repeated_adapters(tmp_path):
    from lmqueue.workers.main import build_parser, settings_from_args

    argv = ["--model", "mock", "--adapter", "a=/x/a", "--adapter", "b=/x/b"]
    settings = settings_from_args(build_parser().parse_args(argv), environ={})
    assert settings.adapters == {"a": "/x/a", "b": "/x/b"}
    with pytest.raises(SettingsError, match="--adapter"):
        settings_from_args(build_parser().parse_args(["--model", "m", "--adapter", "x"]), {})


def test_lmq_adapter_adds_lists_and_removes_records(redis_url, tmp_path, capsys):
    import redis as sync_redis

    from lmqueue.cli import main

    path = fake_adapter(tmp_path / "cli", b"cli weights")
    other = fake_adapter(tmp_path / "cli2", b"other weights")
    base = ["adapter", "--redis-url", redis_url]
    assert main([*base, "add", "mock", f"cli={path}", "--tenant", "alice"]) == 0
    assert main([*base, "add", "mock", f"cli={path}", "--tenant", "alice"]) == 0  # same: fine
    assert main([*base, "add", "mock", f"cli={other}"]) != 0  # other files need --replace
    assert "--replace" in capsys.readouterr().err
    assert main([*base, "list", "mock"]) == 0
    listed = capsys.readouterr().out
    assert f"cli\talice\t{adapter_revision(path)}\t{path}" in listed
    admin = sync_redis.Redis.from_url(redis_url)
    try:
        raw = admin.hget(KEYS.model_adapters("mock"), "cli")
        assert AdapterRecord.from_bytes("cli", raw).tenant == "alice"
        assert main([*base, "add", "mock", f"cli={other}", "--replace"]) == 0
        assert (
            AdapterRecord.from_bytes("cli", admin.hget(KEYS.model_adapters("mock"), "cli")).tenant
            is None
        )
        assert main([*base, "remove", "mock", "cli"]) == 0
        assert admin.hget(KEYS.model_adapters("mock"), "cli") is None
        assert main([*base, "remove", "mock", "cli"]) != 0
        assert main([*base, "add", "mock", f"cli={tmp_path / 'none'}"]) != 0
    finally:
        admin.close()
