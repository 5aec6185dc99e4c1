"""The scheduler's parts that need no processes: regex masks, keys, ACL rules, settings, CLI."""

from __future__ import annotations

import argparse
import datetime
import json

import msgpack
import pytest
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import regex
from arq.constants import in_progress_key_prefix
from redis.crc import key_slot

from lmqueue.experiments_cli import build_params, parse_duration_s, parse_time_s
from lmqueue.producer.experiments import ExperimentStatus, tenant_of_url, validate_experiment_id
from lmqueue.scheduler.acl import experiment_acl_rules
from lmqueue.scheduler.kinds import resolve_kinds
from lmqueue.scheduler.kinds.regex_constraint import RegexConstraint
from lmqueue.scheduler.planes import arq_settings
from lmqueue.scheduler.serialization import pack, unpack
from lmqueue.scheduler.settings import SchedulerSettings
from lmqueue.shared.connections import slot_groups
from lmqueue.shared.errors import InvalidName, SettingsError
from lmqueue.shared.keys import KeySpace, arq_in_progress
from lmqueue.shared.lm.trie import TokenCharacterTrie
from lmqueue.shared.settings import configured_control_url


@pytest.fixture(scope="module")
def smol_trie(smol_tokenizer):
    from lmqueue.workers.backends.mock import MockAsyncLM

    vocab = [bytes(t) for t in MockAsyncLM(smol_tokenizer).byte_vocab]
    return vocab, TokenCharacterTrie(vocab)


@pytest.mark.parametrize("generated", [b"", b"12", b"12 ", b"7 40"])
def test_the_trie_walk_allows_exactly_the_tokens_a_brute_force_check_allows(smol_trie, generated):
    vocab, trie = smol_trie
    pattern = "[0-9]+( [0-9]+)*"
    constraint = RegexConstraint(pattern, trie, eos_token_ids=[0])
    mask = constraint.allowed_after(generated)
    compiled = regex.compile(pattern.encode())
    expected = [
        bool(token) and compiled.fullmatch(generated + token, partial=True) is not None
        for token in vocab
    ]
    expected[0] = compiled.fullmatch(generated) is not None  # EOS: only after a full match
    assert mask.tolist() == expected
    assert 0 < sum(expected) < len(vocab) // 10


def test_experiment_keys_of_one_experiment_share_a_hash_slot_and_a_tenant_prefix():
    keys = KeySpace("lmq", "alice")
    record, results = keys.experiment_record("e1"), keys.experiment_results("e1")
    assert record.split("{")[1].split("}")[0] == results.split("{")[1].split("}")[0] == "alice:e1"
    for key in (record, results, keys.experiment_inbox(), keys.experiment_index()):
        assert key.startswith("lmq:alice:exp:")
    # what only the scheduler writes is outside every tenant's pattern
    assert not keys.experiments_running().startswith("lmq:alice:")
    assert not keys.scheduler_queue().startswith("lmq:alice:")
    assert arq_in_progress("x") == in_progress_key_prefix + "x"


def test_acl_rules_grant_the_tenants_experiment_keys_and_the_client_commands_only():
    rules = experiment_acl_rules("alice")
    assert [r for r in rules if r.startswith("~")] == ["~lmq:alice:exp:*"]
    assert {"+hsetnx", "+hgetall", "+xadd", "+lrange"} <= set(rules)
    assert not {"+keys", "+scan", "+@all", "+eval"} & set(rules)


def test_arq_jobs_serialize_as_msgpack_and_errors_as_text():
    job = {"t": 1, "f": "run_experiment", "a": ["alice", "e1"], "k": {}, "et": 5}
    raw = pack(job)
    assert msgpack.unpackb(raw, raw=False) == job == unpack(raw)
    assert unpack(pack({"r": ValueError("bad")}))["r"] == "ValueError: bad"
    with pytest.raises(TypeError):
        pack({"r": object()})


def test_tenants_come_from_the_urls_user_and_ids_are_checked():
    assert tenant_of_url("redis://alice:pw@host:6379/0") == "alice"
    assert tenant_of_url("redis://host:6379/0") == "default"
    assert tenant_of_url("redis://:pw@host/0", "team") == "team"
    assert validate_experiment_id("score-1.a_b") == "score-1.a_b"
    for bad in ("", "a:b", "{x}", "-x", "x" * 101, "a b"):
        with pytest.raises(InvalidName):
            validate_experiment_id(bad)


def test_a_status_line_shows_progress_rate_waiting_and_error():
    raw = {b"kind": b"score", b"status": b"running", b"done": b"3", b"total": b"10", b"rate": b"2"}
    status = ExperimentStatus.from_record("default", "e", raw)
    assert status.line() == "e  score  running  3/10  2/s" and not status.finished
    raw = {b"kind": b"smc", b"status": b"failed", b"error": b"BadRequest: x", b"done": b"?"}
    failed = ExperimentStatus.from_record("default", "f", raw)
    assert failed.finished and failed.done == 0 and failed.line().endswith("error: BadRequest: x")


def test_scheduler_settings_load_a_json_file_and_name_bad_values(tmp_path):
    config = tmp_path / "s.json"
    config.write_text(
        json.dumps(
            {
                "tenant_urls": {"alice": "redis://alice:pw@h/0"},
                "kinds": {"count": "exp_kinds:count"},
                "cron": [{"name": "n", "kind": "score", "hour": 3, "minute": [0, 30]}],
            }
        )
    )
    settings = SchedulerSettings.load(config, max_jobs=2, lease_s=None, control_url=None)
    assert settings.tenants == ("default", "alice") and settings.max_jobs == 2
    assert settings.control_url is None  # the data URL serves both roles (a single instance)
    assert SchedulerSettings.load(config, control_url="redis://c/0").control_url == "redis://c/0"
    assert configured_control_url({"LMQ_CONTROL_URL": "redis://c/1"}) == "redis://c/1"
    assert configured_control_url({"LMQ_REDIS_URL": "redis://d/0"}) is None
    assert settings.url_of("alice") == "redis://alice:pw@h/0"
    assert settings.url_of("default") == settings.redis_url
    assert settings.cron[0].schedule == {"hour": 3, "minute": [0, 30]}
    with pytest.raises(SettingsError, match="unknown scheduler settings: bogus"):
        SchedulerSettings.load(None, bogus=1)
    with pytest.raises(SettingsError, match="max_running_per_tenant"):
        SchedulerSettings.load(None, max_running_per_tenant=0)
    with pytest.raises(SettingsError, match="tenant_urls"):
        SchedulerSettings.load(None, tenant_urls={"a b": "redis://x"})
    with pytest.raises(SettingsError, match="cannot be imported"):
        resolve_kinds({"x": "no_such_module_here:f"})


def test_cli_durations_times_and_params():
    assert parse_duration_s("90") == 90 and parse_duration_s("5m") == 300
    assert parse_duration_s("1.5h") == 5400 and parse_duration_s("2d") == 172800
    with pytest.raises(SettingsError):
        parse_duration_s("soon")
    utc = datetime.datetime(2026, 11, 24, 3, 0, tzinfo=datetime.UTC).timestamp()
    assert parse_time_s("2026-11-24T03:00") == utc
    assert parse_time_s("2026-11-24T04:00+01:00") == utc
    args = argparse.Namespace(params=None, data=None, set=["n=4", "prompt=hi there", "t=0.5"])
    assert build_params(args) == {"n": 4, "prompt": "hi there", "t": 0.5}


async def test_inboxes_are_one_read_on_a_single_instance_and_one_per_slot_on_a_cluster():
    inboxes = [KeySpace(tenant=t).experiment_inbox().encode() for t in ("default", "alice", "b")]
    tagged = [b"x:{t}:a", b"x:{t}:b"]  # one hash tag: one slot
    plain = aioredis.Redis()
    cluster = aiocluster.RedisCluster(host="127.0.0.1", port=1)  # never connects here
    try:
        assert slot_groups(plain, inboxes + tagged) == [inboxes + tagged]
        groups = slot_groups(cluster, inboxes + tagged)
        assert tagged in groups and len(groups) == len({key_slot(k) for k in inboxes}) + 1
        assert all(len({key_slot(k) for k in group}) == 1 for group in groups)
        assert slot_groups(cluster, []) == slot_groups(plain, []) == []
    finally:
        await plain.aclose()
        await cluster.aclose()


def test_arq_connects_to_a_tls_control_url_with_its_ca_and_hostname_check():
    url = "rediss://sched:pw@ctl.example:6380/2?ssl_ca_certs=/etc/ca.pem&ssl_check_hostname=true"
    settings = arq_settings(url)
    assert (settings.host, settings.port, settings.database, settings.ssl) == (
        "ctl.example",
        6380,
        2,
        True,
    )
    assert (settings.username, settings.ssl_ca_certs, settings.ssl_check_hostname) == (
        "sched",
        "/etc/ca.pem",
        True,
    )
    plain = arq_settings("redis://127.0.0.1:6379/0")
    assert not plain.ssl and plain.ssl_ca_certs is None
