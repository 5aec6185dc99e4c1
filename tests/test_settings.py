"""Settings: read from a dict of environment variables, bad values named with their key."""

from __future__ import annotations

import pytest

from lmqueue.shared.settings import ClientSettings, RedisSettings, SettingsError, WorkerSettings


def test_worker_settings_come_from_lmq_variables():
    env = {
        "LMQ_MODEL": "smollm2-135m",
        "LMQ_BACKEND": "mock",
        "LMQ_BATCH_SIZE": "8",
        "LMQ_CACHE_WRITES": "off",
        "LMQ_BACKEND_OPTS": '{"batch_delay_s": 0.5}',
        "REDIS_URL": "redis://example:6380/2",
        "LMQ_TENANT": "team-a",
    }
    settings = WorkerSettings.from_env(env)
    assert settings.model == "smollm2-135m" and settings.backend == "mock"
    assert settings.batch_size == 8 and settings.cache_writes is False
    assert settings.backend_opts == {"batch_delay_s": 0.5}
    assert settings.redis.url == "redis://example:6380/2"
    assert settings.redis.keyspace().requests("m") == "lmq:team-a:model:{m}:requests"


def test_lmq_redis_url_wins_over_redis_url():
    env = {"REDIS_URL": "redis://a:1/0", "LMQ_REDIS_URL": "redis://b:2/0"}
    assert RedisSettings.from_env(env).url == "redis://b:2/0"


def test_overrides_win_over_the_environment():
    settings = WorkerSettings.from_env({"LMQ_MODEL": "a", "LMQ_BATCH_SIZE": "4"}, batch_size=16)
    assert settings.batch_size == 16


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"LMQ_MODEL": "m", "LMQ_BATCH_SIZE": "many"}, "LMQ_BATCH_SIZE='many'"),
        ({"LMQ_MODEL": "m", "LMQ_CACHE_WRITES": "maybe"}, "LMQ_CACHE_WRITES='maybe'"),
        ({"LMQ_MODEL": "m", "LMQ_BACKEND_OPTS": "[1]"}, "LMQ_BACKEND_OPTS='[1]'"),
        ({"LMQ_MODEL": "m", "LMQ_BACKEND": "tpu"}, "backend='tpu'"),
        ({"LMQ_MODEL": "m", "LMQ_EVENT_LOOP": "trio"}, "event_loop='trio'"),
        ({"LMQ_MODEL": "m", "LMQ_BATCH_SIZE": "0"}, "batch_size=0"),
        ({"LMQ_MODEL": "m", "LMQ_REDIS_URL": "http://x"}, "url='http://x'"),
        ({}, "model is required"),
    ],
)
def test_a_bad_value_is_reported_with_its_key_and_value(env, named):
    with pytest.raises(SettingsError, match=named.replace("[", r"\[").replace("]", r"\]")):
        WorkerSettings.from_env(env)


def test_client_settings_check_the_wire_dtype():
    assert ClientSettings.from_env({"LMQ_WIRE_DTYPE": "float16"}).wire_dtype == "float16"
    with pytest.raises(SettingsError, match="wire_dtype"):
        ClientSettings.from_env({"LMQ_WIRE_DTYPE": "int8"})


def test_half_results_need_float16_on_the_wire():
    env = {"LMQ_WIRE_DTYPE": "float16", "LMQ_HALF_RESULTS": "1"}
    assert ClientSettings.from_env(env).half_results is True
    assert ClientSettings().half_results is False
    for wire in ("float32", "bfloat16"):
        with pytest.raises(SettingsError, match=f"half_results needs wire_dtype='float16'.*{wire}"):
            ClientSettings.from_env({**env, "LMQ_WIRE_DTYPE": wire})


def test_the_cache_role_defaults_to_the_queue_instance():
    settings = RedisSettings.from_url("redis://q:1/0")
    assert settings.effective_cache_url == "redis://q:1/0"
    assert RedisSettings.from_url(
        "redis://q:1/0", cache_url="redis://c:2/0"
    ).effective_cache_url == ("redis://c:2/0")


def test_invalid_tenant_names_are_refused():
    with pytest.raises(SettingsError, match="tenant"):
        RedisSettings(tenant="a b")


def test_the_worker_mmap_threshold_can_be_left_to_glibc_but_not_made_negative():
    env = {"LMQ_MODEL": "m"}
    assert WorkerSettings.from_env(env).malloc_mmap_threshold == 128 * 1024
    assert (
        WorkerSettings.from_env({**env, "LMQ_MALLOC_MMAP_THRESHOLD": "0"}).malloc_mmap_threshold
        == 0
    )
    with pytest.raises(SettingsError, match="malloc_mmap_threshold"):
        WorkerSettings.from_env({**env, "LMQ_MALLOC_MMAP_THRESHOLD": "-1"})
