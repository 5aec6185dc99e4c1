"""``lmq tenant``: the commands an operator runs, against a real redis-server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from redis.exceptions import AuthenticationError

from lmqueue.cli import main
from lmqueue.shared.keys import KeySpace


@pytest.fixture
def admin(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    client.sadd(KeySpace().models(), "mock")
    yield client
    users = [u.decode() for u in client.execute_command("ACL", "USERS") if u != b"default"]
    if users:
        client.execute_command("ACL", "DELUSER", *users)
    client.close()


def _lmq(capsys: pytest.CaptureFixture[str], url: str, *args: str) -> tuple[int, str, str]:
    code = main(["tenant", "--redis-url", url, *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_add_prints_a_url_that_connects_as_the_tenant(
    admin: redis.Redis, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _lmq(capsys, redis_url, "add", "erin", "--weight", "2", "--max-inflight", "5")
    url = out.splitlines()[0]
    assert code == 0 and url.startswith("redis://erin:") and url.endswith("/0")
    erin = redis.Redis.from_url(url)
    assert erin.ping()
    assert erin.hmget(KeySpace(tenant="erin").quota("mock"), "max_inflight") == [b"5"]
    erin.close()
    code, out, _ = _lmq(capsys, redis_url, "list")
    assert code == 0 and "erin" in out and "yes" in out


def test_set_changes_limits_and_rotates_the_password(
    admin: redis.Redis, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _, out, _ = _lmq(capsys, redis_url, "add", "erin")
    old_url = out.splitlines()[0]
    code, out, _ = _lmq(capsys, redis_url, "set", "erin", "--max-tokens-per-s", "500",
                        "--new-password")  # fmt: skip
    new_url = out.splitlines()[0]
    assert code == 0 and new_url != old_url
    quota = KeySpace(tenant="erin").quota("mock")
    assert admin.hmget(quota, "max_tokens_per_s", "max_inflight") == [b"500.0", b"0"]
    with pytest.raises(AuthenticationError):
        redis.Redis.from_url(old_url).ping()
    assert redis.Redis.from_url(new_url).ping()


def test_remove_deletes_the_user_and_its_settings(
    admin: redis.Redis, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _lmq(capsys, redis_url, "add", "erin")
    code, _, _ = _lmq(capsys, redis_url, "remove", "erin")
    assert code == 0
    assert b"erin" not in admin.execute_command("ACL", "USERS")
    assert not admin.hexists(KeySpace().tenants(), "erin")
    assert not admin.exists(KeySpace(tenant="erin").quota("mock"))


def test_worker_user_prints_its_url(
    admin: redis.Redis, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _lmq(capsys, redis_url, "worker-user")
    assert code == 0 and out.startswith("redis://lmq-worker:")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["add", "Bad Name"], "invalid tenant name"),
        (["add", "model"], "reserved"),
        (["set", "nobody", "--weight", "2"], "no tenant"),
        (["add", "erin", "--weight", "0"], "weight must be positive"),
        (["add", "erin", "--cache-namespace", "shared"], "invalid cache namespace"),
    ],
)
def test_mistakes_are_one_line_with_exit_2(
    admin: redis.Redis,
    redis_url: str,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    code, _, err = _lmq(capsys, redis_url, *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_adding_a_tenant_twice_is_refused(
    admin: redis.Redis, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _lmq(capsys, redis_url, "add", "erin")
    code, _, err = _lmq(capsys, redis_url, "add", "erin")
    assert code == 2 and "exists" in err


def test_a_separate_cache_instance_gets_the_same_users(
    admin: redis.Redis, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from lmqueue.devstack import LocalRedis

    with LocalRedis() as cache_server:
        code, out, _ = _lmq(capsys, redis_url, "add", "erin", "--cache-url", cache_server.url)
        queue_url, note = out.splitlines()[:2]
        assert code == 0 and cache_server.url in note and "erin:" not in note
        # the one URL printed first logs in at the cache instance too (same password)
        host = cache_server.url.split("//")[1]
        erin = redis.Redis.from_url(queue_url.split("@")[0] + "@" + host)
        assert erin.mget([KeySpace(tenant="erin").cache_entry("m", "r", "k", b"1234")]) == [None]
        erin.close()


def test_the_connection_flags_go_after_the_action_too(
    admin: redis.Redis, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["tenant", "add", "erin", "--redis-url", redis_url, "--prefix", "lmq"])
    out, _ = capsys.readouterr()
    assert code == 0 and out.startswith("redis://erin:")
    assert main(["tenant", "list", "--redis-url", redis_url]) == 0
    assert "erin" in capsys.readouterr().out


def test_the_cache_the_workers_publish_gets_the_user_without_a_flag(
    admin: redis.Redis, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from lmqueue.devstack import LocalRedis
    from lmqueue.shared.registry import ModelInfo

    with LocalRedis() as cache_server:
        info = ModelInfo("mock", "r", "mock", 10, 10, 0, cache_address=cache_server.url)
        admin.set(KeySpace().model_info("mock"), info.to_bytes())
        code, out, _ = _lmq(capsys, redis_url, "add", "erin")
        assert code == 0 and cache_server.url in out.splitlines()[1]
        users = redis.Redis.from_url(cache_server.url).execute_command("ACL", "USERS")
        assert b"erin" in users


def test_a_cache_that_refuses_the_admin_leaves_no_tenant_anywhere(
    admin: redis.Redis, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from lmqueue.devstack import LocalRedis

    with LocalRedis() as cache_server:
        redis.Redis.from_url(cache_server.url).config_set("requirepass", "cache-admin-secret")
        wrong = cache_server.url.replace("redis://", "redis://default:not-it@")
        code, out, err = _lmq(capsys, redis_url, "add", "erin", "--cache-url", wrong)
        assert code == 2 and out == "" and "nothing changed" in err
        assert "not-it" not in err and "default:***@" in err
        assert b"erin" not in admin.execute_command("ACL", "USERS")
        assert not admin.hexists(KeySpace().tenants(), "erin")
