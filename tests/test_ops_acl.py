"""ops/redis configs ship with ACLs on: nothing but PING without a user; `lmq tenant` users last."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import redis

from lmqueue.devstack import LocalRedis
from lmqueue.shared.tenants import TenantConfig
from lmqueue.tenant_admin import TenantAdmin

OPS = Path(__file__).resolve().parent.parent / "ops" / "redis"


def _included(role: str) -> str:
    """The role's config without where it listens and writes (LocalRedis sets those)."""
    text = (OPS / f"{role}.conf").read_text()
    return re.sub(r"^(port|bind|dir) .*$", "", text, flags=re.M)


def _bootstrapped(tmp_path: Path, role: str) -> LocalRedis:
    """The role's config with the example ACL file (admin password "pw") in place."""
    acl = tmp_path / "users.acl"
    digest = hashlib.sha256(b"pw").hexdigest()
    acl.write_text((OPS / "users.acl.example").read_text().replace("<sha256-of-password>", digest))
    conf = _included(role).replace("/data/users.acl", str(acl))
    conf = conf.replace("maxmemory 4gb", "maxmemory 64mb").replace(
        "maxmemory 8gb", "maxmemory 64mb"
    )
    (tmp_path / f"{role}.conf").write_text(conf)
    return LocalRedis(args=["--include", str(tmp_path / f"{role}.conf")])


@pytest.mark.parametrize("role", ["queue", "cache"])
def test_without_a_user_only_ping_is_allowed(tmp_path: Path, role: str) -> None:
    with _bootstrapped(tmp_path, role) as server:
        anonymous = redis.Redis(port=server.port)
        assert anonymous.ping()
        for command in (("GET", "x"), ("KEYS", "*"), ("CONFIG", "GET", "*"), ("XLEN", "s")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                anonymous.execute_command(*command)
        admin = redis.Redis(port=server.port, username="lmq-admin", password="pw")
        assert admin.set("x", 1)


def test_tenant_users_are_saved_and_survive_a_restart(tmp_path: Path) -> None:
    with _bootstrapped(tmp_path, "queue") as server:
        admin_url = f"redis://lmq-admin:pw@127.0.0.1:{server.port}/0"
        admin = redis.Redis.from_url(admin_url)
        url = TenantAdmin(admin, admin_url).add(TenantConfig("alice"))
        admin.close()
        assert "user alice on" in (tmp_path / "users.acl").read_text()
        server.restart()
        assert redis.Redis.from_url(url).ping()


def test_redis_refuses_to_start_without_the_acl_file(tmp_path: Path) -> None:
    conf = _included("queue").replace("/data/users.acl", str(tmp_path / "none"))
    (tmp_path / "queue.conf").write_text(conf)
    server = LocalRedis(args=["--include", str(tmp_path / "queue.conf")])
    with pytest.raises(RuntimeError, match="exited with 1"):
        server.start(timeout_s=5)
    server.close()


@pytest.mark.parametrize("role", ["queue", "cache"])
def test_the_compose_stacks_acl_init_writes_a_file_each_config_starts_with(
    tmp_path: Path, role: str
) -> None:
    """docker-compose.yml's `acl-init` script, run here as compose would run it."""
    import subprocess

    import yaml

    compose = yaml.safe_load((OPS.parent.parent / "docker-compose.yml").read_text())
    script = compose["services"]["acl-init"]["command"][0].replace("$$", "$")  # compose escape
    script = script.replace("/queue", str(tmp_path / "queue")).replace(
        "/cache", str(tmp_path / "cache")
    )
    for name in ("queue", "cache"):
        (tmp_path / name).mkdir()
    env = {"LMQ_ADMIN_PASSWORD": "s3cret", "PATH": "/usr/bin:/bin"}
    subprocess.run(["sh", "-c", script], check=True, env=env)
    subprocess.run(["sh", "-c", script], check=True, env={**env, "LMQ_ADMIN_PASSWORD": "other"})
    acl = tmp_path / role / "users.acl"
    conf = _included(role).replace("/data/users.acl", str(acl))
    conf = conf.replace("maxmemory 4gb", "maxmemory 64mb").replace(
        "maxmemory 8gb", "maxmemory 64mb"
    )
    (tmp_path / f"{role}.conf").write_text(conf)
    with LocalRedis(args=["--include", str(tmp_path / f"{role}.conf")]) as server:
        assert redis.Redis(port=server.port).ping()  # the healthcheck's anonymous PING
        with pytest.raises(redis.exceptions.NoPermissionError):
            redis.Redis(port=server.port).get("x")
        # the first start's password stays: a second run of acl-init changes nothing
        admin = redis.Redis(port=server.port, username="lmq-admin", password="s3cret")
        assert admin.set("x", 1)
