"""The wheel installs one top-level package, `lmqueue`, which nothing beside a user's script
can shadow.

The suite itself imports the editable install; this builds the real wheel, installs it into a
fresh virtual environment and imports it from a directory that holds packages named like the
repository's folders (`shared`, `workers`), as a monorepo would.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A fresh venv with the wheel alone (its dependencies come from this environment)."""
    work = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(work / "dist"), str(ROOT)],
        check=True, capture_output=True,
    )  # fmt: skip
    wheel = next((work / "dist").glob("lmqueue-*.whl"))
    env_dir = work / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         str(wheel)],
        check=True, capture_output=True,
    )  # fmt: skip
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
    )  # fmt: skip
    return python, site


def test_the_wheel_adds_lmqueue_alone_to_site_packages(installed: tuple[Path, Path]) -> None:
    _, site = installed
    added = {p.name for p in site.iterdir() if not p.name.endswith((".dist-info", ".pth"))}
    assert added - {"_distutils_hack", "pip", "setuptools", "__pycache__"} == {"lmqueue"}
    assert {p.name for p in (site / "lmqueue").iterdir()} >= {
        "shared", "producer", "workers", "scheduler", "bench", "cli.py",
    }  # fmt: skip


def test_lmqueue_imports_beside_a_users_own_shared_and_workers_packages(
    installed: tuple[Path, Path], tmp_path: Path
) -> None:
    python, site = installed
    for name in ("shared", "workers", "producer", "scheduler"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('the user\\'s {name}')\n")
    # The third-party dependencies come from the test environment, after the venv's own.
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    probe = (
        "import lmqueue, lmqueue.workers.worker, lmqueue.scheduler.main\n"
        "from lmqueue import QueueLM, QueueTrie, Experiments\n"
        "print(lmqueue.__file__); print(lmqueue.workers.worker.__file__)\n"
    )
    done = subprocess.run(
        [str(python), "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    for line in done.stdout.split():
        assert Path(line).is_relative_to(site), line
