"""What each overlay deploys: a GPU overlay requests a GPU and sets its backend; every tenant's
request streams have a KEDA trigger; a fleet that scales to zero waits for a cold start no
longer than its clients do; one admin user name everywhere.

Tenants are proven against a real redis-server started with the overlay's own bootstrap ACL
file: the tenants are made there with `lmq tenant add`'s code, each logs in with the URL it was
given and writes the stream its trigger watches, and `lmq keda-triggers` reads them back.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from test_manifests import OVERLAYS, by_kind, container_env, rendered

from lmqueue.devstack import LocalRedis
from lmqueue.keda_triggers import served_tenants, stream_triggers
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.partitions import stream_partitions
from lmqueue.shared.tenants import TenantConfig
from lmqueue.tenant_admin import TenantAdmin

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "ops" / "k8s"
GPU_OVERLAYS = [o for o in OVERLAYS if o.startswith("gpu-")]
#: A client's deadline when LMQ_TIMEOUT_S is not set (README, "Configuration").
DEFAULT_CLIENT_TIMEOUT_S = 120.0


def _worker(objects: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The worker's pod spec and its environment."""
    pod = by_kind(objects, "Deployment", "lmq-worker")["spec"]["template"]["spec"]
    return pod, container_env(objects, pod["containers"][0])


def test_the_overlays_are_a_cpu_fleet_and_one_gpu_fleet_per_backend() -> None:
    assert set(OVERLAYS) == {"cpu", "gpu-hf", "gpu-vllm"}


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_a_gpu_overlay_requests_a_gpu_and_sets_its_backend(overlay: str) -> None:
    pod, env = _worker(rendered(overlay))
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert env["LMQ_BACKEND"] == overlay.removeprefix("gpu-")
    assert env["LMQ_MODEL"]
    json.loads(env.get("LMQ_BACKEND_OPTS", "{}"))  # valid JSON, as the worker parses it


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_a_gpu_worker_mounts_models_adapters_and_the_hub_token(overlay: str) -> None:
    objects = rendered(overlay)
    pod, env = _worker(objects)
    (container,) = pod["containers"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["models"]["mountPath"] == "/models" and not mounts["models"].get("readOnly")
    assert mounts["adapters"] == {"name": "adapters", "mountPath": "/adapters", "readOnly": True}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    for name, claim in (("models", "lmq-models"), ("adapters", "lmq-adapters")):
        assert volumes[name]["persistentVolumeClaim"]["claimName"] == claim
        pvc = by_kind(objects, "PersistentVolumeClaim", claim)
        assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # every worker, any node
    assert env["HF_HOME"].startswith("/models/")  # hub downloads land on the shared volume
    (token,) = [e for e in container["env"] if e["name"] == "HF_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {
        "name": "lmq-hf-token", "key": "token", "optional": True,
    }  # fmt: skip


def test_the_vllm_overlay_sizes_its_engine_for_lora_adapters() -> None:
    _, env = _worker(rendered("gpu-vllm"))
    engine = json.loads(env["LMQ_BACKEND_OPTS"])["engine_opts"]
    assert engine["enable_lora"] is True and engine["max_lora_rank"] >= 8
    assert engine["max_loras"] >= 4 and 0 < engine["gpu_memory_utilization"] < 1
    assert "LMQ_DEVICE" not in env  # the vllm backend refuses --device


def test_the_hf_overlay_places_the_model_on_the_gpu() -> None:
    _, env = _worker(rendered("gpu-hf"))
    assert env["LMQ_DEVICE"].startswith("cuda")
    assert json.loads(env["LMQ_BACKEND_OPTS"])["engine_opts"]["dtype"] == "bfloat16"


# -- tenants and triggers ------------------------------------------------------------------------
def _triggers(objects: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    return list(by_kind(objects, "ScaledObject", "lmq-worker")["spec"]["triggers"])


def _trigger_tenants(objects: tuple[dict[str, Any], ...]) -> set[str]:
    return {t["metadata"]["stream"].split(":")[1] for t in _triggers(objects)}


def _scheduler_tenants(objects: tuple[dict[str, Any], ...]) -> set[str]:
    secret = by_kind(objects, "Secret", "lmq-scheduler")
    return set(json.loads(secret["stringData"]["scheduler.json"])["tenant_urls"])


def trigger_problems(objects: tuple[dict[str, Any], ...]) -> list[str]:
    """Why the ScaledObject does not watch exactly every stream of every tenant it names
    and of every tenant the scheduler serves (empty: it does)."""
    _, env = _worker(objects)
    scaled = by_kind(objects, "ScaledObject", "lmq-worker")
    namespace = scaled["metadata"]["namespace"]
    tenants = _trigger_tenants(objects) | _scheduler_tenants(objects)
    expected = stream_triggers(
        env["LMQ_MODEL"], sorted(tenants), int(env.get("LMQ_PARTITIONS") or 1),
        f"lmq-redis-queue.{namespace}.svc.cluster.local:6379",
        int(_triggers(objects)[0]["metadata"]["streamLength"]),
    )  # fmt: skip
    want = {t["metadata"]["stream"] for t in expected}
    have = {t["metadata"]["stream"] for t in _triggers(objects)}
    problems = [f"no trigger watches {stream}" for stream in sorted(want - have)]
    problems += [f"a trigger watches {stream}, no stream of this fleet" for stream in have - want]
    if not problems and _triggers(objects) != expected:
        problems.append("triggers differ from `lmq keda-triggers` output (address, names)")
    return problems


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_tenant_of_each_overlay_has_a_trigger_on_each_of_its_streams(overlay: str) -> None:
    objects = rendered(overlay)
    assert trigger_problems(objects) == []
    assert _scheduler_tenants(objects) <= _trigger_tenants(objects)
    assert "default" not in _trigger_tenants(objects)  # the shipped ACL lets default only PING


def test_a_tenant_without_a_trigger_or_a_missing_partition_is_caught() -> None:
    objects = copy.deepcopy(rendered("gpu-vllm"))
    secret = by_kind(objects, "Secret", "lmq-scheduler")
    config = json.loads(secret["stringData"]["scheduler.json"])
    config["tenant_urls"]["carol"] = "redis://carol:x@lmq-redis-queue:6379/0"
    secret["stringData"]["scheduler.json"] = json.dumps(config)
    assert trigger_problems(objects) == [
        "no trigger watches lmq:carol:model:{HuggingFaceTB/SmolLM2-1.7B-Instruct}:requests"
    ]
    objects = copy.deepcopy(rendered("gpu-vllm"))
    pod, _ = _worker(objects)
    pod["containers"][0]["env"].append({"name": "LMQ_PARTITIONS", "value": "2"})
    problems = trigger_problems(objects)
    assert (
        "no trigger watches lmq:alice:model:{HuggingFaceTB/SmolLM2-1.7B-Instruct:1}:requests"
        in (problems)
    )


def _header_command(overlay: str) -> list[str]:
    lines = (K8S / "overlays" / overlay / "keda-triggers.yaml").read_text().splitlines()
    (command,) = [line[4:] for line in lines if line.startswith("#   lmq keda-triggers")]
    return command.split()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlays_triggers_regenerate_from_the_command_in_their_header(overlay: str) -> None:
    command = _header_command(overlay)
    assert command[:2] == ["lmq", "keda-triggers"]
    done = subprocess.run(
        [sys.executable, "-m", "lmqueue", *command[1:]], capture_output=True, text=True, check=True
    )
    assert done.stdout == (K8S / "overlays" / overlay / "keda-triggers.yaml").read_text()


def _bootstrap_acl(objects: tuple[dict[str, Any], ...], password: str) -> str:
    acl = by_kind(objects, "Secret", "lmq-redis-acl")["stringData"]["users.acl"]
    return acl.replace("REPLACE-ME-admin-password", password)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_with_the_overlays_own_acl_every_tenant_writes_exactly_the_streams_keda_watches(
    overlay: str, tmp_path: Path
) -> None:
    """A real redis-server with the overlay's bootstrap ACL file; its tenants made as `lmq
    tenant add` makes them; `lmq keda-triggers` reads them back from that Redis."""
    objects = rendered(overlay)
    _, env = _worker(objects)
    model, partitions = env["LMQ_MODEL"], int(env.get("LMQ_PARTITIONS") or 1)
    (tmp_path / "users.acl").write_text(_bootstrap_acl(objects, "pw"))
    with LocalRedis(args=["--aclfile", str(tmp_path / "users.acl")]) as server:
        admin_url = f"redis://lmq-admin:pw@127.0.0.1:{server.port}/0"
        admin = redis.Redis.from_url(admin_url)
        urls = {t: TenantAdmin(admin, admin_url).add(TenantConfig(t)) for t in ("alice", "bob")}
        assert served_tenants(admin, model) == ["alice", "bob"]  # not `default`
        for tenant, url in urls.items():
            client = redis.Redis.from_url(url)
            for partition in stream_partitions(partitions):
                stream = KeySpace(tenant=tenant).requests(model, partition)
                assert client.xadd(stream, {"probe": "1"})  # the tenant's own stream
            client.close()
        anonymous = redis.Redis(port=server.port)
        with pytest.raises(redis.exceptions.NoPermissionError):
            anonymous.xadd(KeySpace().requests(model), {"probe": "1"})
        done = subprocess.run(
            [sys.executable, "-m", "lmqueue", "keda-triggers", "--model", model,
             "--namespace", _namespace(objects), "--redis-url", admin_url],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        admin.close()
    (patch,) = yaml.safe_load(done.stdout)
    watched = {t["metadata"]["stream"] for t in patch["value"]}
    assert watched == {t["metadata"]["stream"] for t in _triggers(objects)}
    assert "pw" not in done.stdout + done.stderr


def _namespace(objects: tuple[dict[str, Any], ...]) -> str:
    (namespace,) = [o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"]
    return namespace


def test_partitions_published_by_the_workers_give_one_trigger_per_partition(
    redis_url: str,
) -> None:
    from lmqueue.shared.registry import ModelInfo

    admin = redis.Redis.from_url(redis_url)
    admin.hset(KeySpace().tenants(), "alice", TenantConfig("alice").to_json())
    info = ModelInfo("m", "r", "mock", vocab_size=8, vector_size=8, max_prompt_tokens=8,
                     partitions=3)  # fmt: skip
    admin.set(KeySpace().model_info("m"), info.to_bytes())
    admin.close()
    done = subprocess.run(
        [sys.executable, "-m", "lmqueue", "keda-triggers", "--model", "m",
         "--redis-url", redis_url],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    (patch,) = yaml.safe_load(done.stdout)
    streams = [t["metadata"]["stream"] for t in patch["value"]]
    # this Redis has no ACLs: its default user writes the default tenant's streams too
    assert streams == [
        f"lmq:{tenant}:model:{{m:{p}}}:requests"
        for tenant in ("alice", "default")
        for p in range(3)
    ]
    assert "--partitions 3" in done.stdout


# -- scale from zero and the client's deadline ---------------------------------------------------
def cold_start_problems(objects: tuple[dict[str, Any], ...]) -> list[str]:
    """Why a fleet that scales to zero would fail its in-cluster clients' first requests
    (empty: it keeps a worker warm, or the scheduler's deadline covers a cold start)."""
    scaled = by_kind(objects, "ScaledObject", "lmq-worker")["spec"]
    if scaled["minReplicaCount"] > 0:
        return []
    pod, _ = _worker(objects)
    probe = pod["containers"][0]["startupProbe"]
    start_s = (
        probe.get("initialDelaySeconds", 0) + probe["periodSeconds"] * probe["failureThreshold"]
    )
    budget_s = scaled.get("pollingInterval", 30) + start_s
    scheduler = by_kind(objects, "Deployment", "lmq-scheduler")["spec"]["template"]["spec"]
    timeout = container_env(objects, scheduler["containers"][0]).get("LMQ_TIMEOUT_S")
    timeout_s = float(timeout) if timeout is not None else DEFAULT_CLIENT_TIMEOUT_S
    if timeout_s == 0 or timeout_s >= budget_s:
        return []
    return [f"scales to zero: a cold start may take {budget_s:g} s, clients wait {timeout_s:g} s"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_overlay_scales_to_zero_past_its_clients_deadline(overlay: str) -> None:
    objects = rendered(overlay)
    assert cold_start_problems(objects) == []
    assert by_kind(objects, "ScaledObject", "lmq-worker")["spec"]["minReplicaCount"] == 1


def test_scaling_to_zero_needs_clients_that_wait_out_a_cold_start() -> None:
    objects = copy.deepcopy(rendered("gpu-hf"))
    by_kind(objects, "ScaledObject", "lmq-worker")["spec"]["minReplicaCount"] = 0
    assert cold_start_problems(objects) == [
        "scales to zero: a cold start may take 615 s, clients wait 120 s"
    ]
    scheduler = by_kind(objects, "Deployment", "lmq-scheduler")["spec"]["template"]["spec"]
    scheduler["containers"][0]["env"].append({"name": "LMQ_TIMEOUT_S", "value": "900"})
    assert cold_start_problems(objects) == []


# -- one admin user ------------------------------------------------------------------------------
def _acl_superusers(text: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^\s*user (\S+) on .*\+@all", text, re.M)}


def test_the_operators_user_is_lmq_admin_in_every_file() -> None:
    objects = rendered("gpu-vllm")
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    acl_init = compose["services"]["acl-init"]["command"][0]
    names = {
        "k8s bootstrap ACL": _acl_superusers(_bootstrap_acl(objects, "x")),
        "users.acl.example": _acl_superusers((ROOT / "ops/redis/users.acl.example").read_text()),
        "compose acl-init": set(re.findall(r"user (\S+) on >%s ~\* &\* \+@all", acl_init)),
        "SECURITY.md bootstrap": _acl_superusers((ROOT / "docs/SECURITY.md").read_text()),
    }
    urls = [
        by_kind(objects, "Secret", "lmq-scheduler")["stringData"]["url"],
        *compose["x-admin-urls"].values(),
    ]
    names["admin URLs"] = {re.match(r"rediss?://([^:]+):", url).group(1) for url in urls}  # type: ignore[union-attr]
    assert all(found == {"lmq-admin"} for found in names.values()), names
    for doc in ("README.md", "docs/OPERATIONS.md", "docs/SECURITY.md"):
        text = (ROOT / doc).read_text()
        assert "redis://admin:" not in text and "an `admin` user" not in text, doc
