"""ops/redis/*.conf as shipped: each states its port, bind address and directory, and a real
redis-server started from it listens where the file says (loopback), with the role's policy;
the cache's policy keeps the freshest entries when it holds less than a second of writes."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from lmqueue.devstack import CACHE_POLICY, free_port, stop_process
from lmqueue.shared.shared_cache import SharedCache

OPS_REDIS = Path(__file__).resolve().parent.parent / "ops" / "redis"


def _directives(role: str) -> dict[str, str]:
    lines = (OPS_REDIS / f"{role}.conf").read_text().splitlines()
    pairs = (line.split(None, 1) for line in lines if line.strip() and not line.startswith("#"))
    return {key: value for key, value in pairs}


@pytest.mark.parametrize(("role", "port"), [("queue", "6379"), ("cache", "6380")])
def test_each_conf_states_port_bind_and_dir_with_a_comment(role: str, port: str) -> None:
    found = _directives(role)
    assert found["port"] == port
    assert found["bind"] == "127.0.0.1 -::1" and found["protected-mode"] == "yes"
    assert found["dir"] == "/data" and found["aclfile"] == "/data/users.acl"
    paragraphs = (OPS_REDIS / f"{role}.conf").read_text().split("\n\n")
    for key in ("port", "bind", "dir"):  # each set under a comment that explains it
        (paragraph,) = [p for p in paragraphs if re.search(rf"^{key} ", p, re.M)]
        comment = " ".join(line for line in paragraph.splitlines() if line.startswith("#"))
        assert comment and ("listens" in comment if key != "dir" else "written" in comment)


@contextlib.contextmanager
def _server_from_conf(role: str, tmp_path: Path, maxmemory: str = "64mb") -> Iterator[redis.Redis]:
    """A redis-server started from ``ops/redis/<role>.conf`` as shipped, but for its port (a
    free one), its directory (a temporary one) and its maxmemory; a client of it."""
    binary = shutil.which("redis-server")
    assert binary is not None
    (tmp_path / "users.acl").write_text("user default on nopass ~* &* +@all\n")
    port = free_port()
    text = (OPS_REDIS / f"{role}.conf").read_text().replace("/data", str(tmp_path))
    text = re.sub(r"^port .*$", f"port {port}", text, flags=re.M)
    text = re.sub(r"^maxmemory .*$", f"maxmemory {maxmemory}", text, flags=re.M)
    conf = tmp_path / f"{role}.conf"
    conf.write_text(text)
    process = subprocess.Popen(
        [binary, str(conf)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    client = redis.Redis(port=port)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline and process.poll() is None
                time.sleep(0.05)
        yield client
    finally:
        client.close()
        stop_process(process, grace_s=10)


@pytest.mark.parametrize("role", ["queue", "cache"])
def test_a_redis_server_started_from_the_conf_listens_on_loopback_with_its_policy(
    role: str, tmp_path: Path
) -> None:
    with _server_from_conf(role, tmp_path) as client:
        assert client.config_get("bind")["bind"] == "127.0.0.1 -::1"
        assert client.config_get("dir")["dir"] == str(tmp_path)
        policy = "noeviction" if role == "queue" else CACHE_POLICY
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == policy


def test_the_cache_conf_keeps_its_freshest_entries_when_writes_outrun_its_memory(
    tmp_path: Path,
) -> None:
    """Three times its memory in entries, written as workers write them (the SET of
    `SharedCache.set_commands`, one TTL), well within a second: the last tenth of what it holds
    is all there, as claim-checks fetched just after their write need. Under ``allkeys-lru``
    (the policy shipped before) some of those were evicted: Redis's one-second LRU clock
    gave every entry the same age, and it evicted among them at random."""
    value = bytes(16 * 1024)
    keys = [f"lmq:t:cache:{i:05d}" for i in range(3_000)]  # 48 MB into a 16 MB cache
    with _server_from_conf("cache", tmp_path, maxmemory="16mb") as client:
        for first in range(0, len(keys), 100):
            pipe = client.pipeline(transaction=False)
            for command in SharedCache.set_commands(
                [(key, value) for key in keys[first : first + 100]], 3600
            ):
                pipe.execute_command(*command)
            pipe.execute()
        held = client.dbsize()
        assert held < len(keys) // 2  # it evicted: the test's premise
        freshest = keys[-held // 10 :]
        missing = [key for key in freshest if not client.exists(key)]
        assert not missing, f"{len(missing)} of the {len(freshest)} freshest entries evicted"
        assert client.ttl(keys[-1]) > 3000  # written with the workers' TTL
