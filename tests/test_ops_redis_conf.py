"""ops/redis/*.conf as shipped: each states its port, bind address and directory, and a real
redis-server started from it listens where the file says (loopback), with the role's policy."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis

from lmqueue.devstack import free_port, stop_process

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


@pytest.mark.parametrize("role", ["queue", "cache"])
def test_a_redis_server_started_from_the_conf_listens_on_loopback_with_its_policy(
    role: str, tmp_path: Path
) -> None:
    binary = shutil.which("redis-server")
    assert binary is not None
    (tmp_path / "users.acl").write_text("user default on nopass ~* &* +@all\n")
    port = free_port()
    # the file as shipped, but for the port (a free one) and the directory (a temporary one)
    text = (OPS_REDIS / f"{role}.conf").read_text().replace("/data", str(tmp_path))
    text = re.sub(r"^port .*$", f"port {port}", text, flags=re.M)
    conf = tmp_path / f"{role}.conf"
    conf.write_text(text.replace("maxmemory 4gb", "maxmemory 64mb"))
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
        assert client.config_get("bind")["bind"] == "127.0.0.1 -::1"
        assert client.config_get("dir")["dir"] == str(tmp_path)
        policy = "noeviction" if role == "queue" else "allkeys-lru"
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == policy
    finally:
        client.close()
        stop_process(process, grace_s=10)
