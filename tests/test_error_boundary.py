"""One error boundary: what Redis and the network say becomes the `shared.errors` tree."""

from __future__ import annotations

import socket

import pytest
import redis
from redis.exceptions import BusyLoadingError, NoPermissionError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from lmqueue.producer import QueueLM
from lmqueue.shared.errors import (
    BadRequest,
    Busy,
    Forbidden,
    InvalidName,
    LMQueueError,
    SettingsError,
    Unavailable,
    UnknownModel,
    from_wire,
    to_wire,
)
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.redis_errors import redis_boundary, translate
from lmqueue.shared.settings import RedisSettings


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (RedisConnectionError("Connection refused"), Unavailable),
        (RedisTimeoutError("Timeout reading from socket"), Unavailable),
        (BusyLoadingError("Redis is loading the dataset in memory"), Unavailable),
        (ConnectionResetError("reset by peer"), Unavailable),
        (OSError("Network is unreachable"), Unavailable),
        (ResponseError("OOM command not allowed when used memory > 'maxmemory'."), Busy),
        (ResponseError("BUSY Redis is busy running a script."), Busy),
        (NoPermissionError("NOPERM User alice has no permissions to access a key"), Forbidden),
        (ResponseError("NOPERM this user has no permissions to run the 'xadd' command"), Forbidden),
        (ResponseError("READONLY You can't write against a read only replica."), Unavailable),
        (ResponseError("WRONGTYPE Operation against a key holding the wrong kind"), Unavailable),
    ],
)
def test_each_redis_failure_maps_to_one_lmqueue_error(raised, expected):
    error = translate(raised, "doing x")
    assert type(error) is expected
    assert error.message.startswith("doing x: ")
    with pytest.raises(expected) as caught, redis_boundary("doing x"):
        raise raised
    assert caught.value.__cause__ is raised


def test_the_boundary_lets_lmqueue_errors_and_foreign_errors_pass_unchanged():
    original = UnknownModel("no such model")
    with pytest.raises(UnknownModel) as caught, redis_boundary("connecting"):
        raise original
    assert caught.value is original
    with pytest.raises(KeyError), redis_boundary("connecting"):
        raise KeyError("a bug stays a bug")


def test_settings_and_name_errors_belong_to_the_tree_and_travel_by_type():
    assert issubclass(SettingsError, LMQueueError) and issubclass(SettingsError, ValueError)
    assert issubclass(InvalidName, BadRequest)
    with pytest.raises(InvalidName):
        KeySpace(tenant="no spaces")
    with pytest.raises(SettingsError, match="tenant"):
        RedisSettings(tenant="no spaces")
    for error in (SettingsError("bad"), InvalidName("bad"), Forbidden("no")):
        assert type(from_wire(to_wire(error))) is type(error)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_connecting_to_an_unreachable_redis_raises_unavailable():
    url = f"redis://127.0.0.1:{_closed_port()}/0"
    with pytest.raises(Unavailable, match="cannot be reached") as caught:
        await QueueLM.connect("some-model", redis_url=url, connect_timeout_s=0.3)
    assert isinstance(caught.value.__cause__, (RedisConnectionError, OSError))


async def test_connecting_as_a_user_redis_refuses_raises_forbidden(redis_url):
    admin = redis.Redis.from_url(redis_url)
    admin.acl_setuser("nobody", enabled=True, passwords=["+pw"], commands=["+ping"], keys=[])
    try:
        url = redis_url.replace("redis://", "redis://nobody:pw@")
        with pytest.raises(Forbidden, match="NOPERM|no permissions"):
            await QueueLM.connect("some-model", redis_url=url, connect_timeout_s=0.3)
    finally:
        admin.acl_deluser("nobody")
        admin.close()


async def test_connecting_to_a_model_nobody_serves_raises_unknown_model(redis_url):
    with pytest.raises(UnknownModel, match="no-such-model"):
        await QueueLM.connect("no-such-model", redis_url=redis_url, connect_timeout_s=0.2)


async def test_a_cluster_pipeline_caught_mid_reinitialization_fails_as_a_connection_error():
    """redis-py 5.3's cluster race (see `execute_pipeline`) becomes what the writer retries."""
    import redis.asyncio.cluster as aiocluster

    from lmqueue.shared.connections import execute_pipeline
    from lmqueue.shared.redis_errors import REDIS_DOWN

    class Racing(aiocluster.ClusterPipeline):
        def __init__(self) -> None:  # no client: only `execute` matters here
            pass

        async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True):
            raise AttributeError("'NoneType' object has no attribute 'name'")

    with pytest.raises(REDIS_DOWN) as caught:
        await execute_pipeline(Racing(), raise_on_error=False)
    assert isinstance(caught.value.__cause__, AttributeError)
    with pytest.raises(AttributeError):  # anything else that raises it is a bug, not Redis
        await execute_pipeline(_NotAPipelineOfACluster())


class _NotAPipelineOfACluster:
    async def execute(self, raise_on_error: bool = True) -> list[object]:
        raise AttributeError("a bug")
