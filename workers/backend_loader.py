"""Building the backend a worker's settings name.

``LMQ_BACKEND_OPTS`` (``--backend-opts``) is a JSON object of the backend's `from_name`
options, ``engine_opts`` among them (see `workers.backends.options`). The worker's own
batching settings become the defaults of a backend that batches by itself (hf: one stream
batch becomes one forward), and ``--device`` goes to the backends that can place a model;
anything a backend cannot honour is refused with `SettingsError` before loading starts. A
backend that must be sized for LoRA adapters when it starts (vllm) gets the directories of
``--adapter`` as ``adapter_paths``; the worker loads the adapters themselves afterwards.
A backend that computes on forward threads of its own (hf) gets the process's torch threads
there, split over its ``parallel_forwards`` (``forward_threads`` each), and every other
thread one (`one_torch_team`).
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from typing import Any

from lmqueue.shared.errors import SettingsError
from lmqueue.shared.lm.interface import AsyncLM
from lmqueue.shared.settings import BACKENDS, WorkerSettings

__all__ = [
    "backend_class",
    "backend_options",
    "batching_for_device",
    "load_backend",
    "one_torch_team",
]


def backend_class(name: str) -> Any:
    """The class of backend `name` (`BACKENDS`; its engine is imported only by `from_name`)."""
    if name not in BACKENDS:
        raise SettingsError(f"backend={name!r}: expected one of {', '.join(BACKENDS)}")
    module, attribute = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), attribute)


def backend_options(settings: WorkerSettings, accepted: frozenset[str]) -> dict[str, Any]:
    """The keyword arguments of `from_name`: the backend options over the worker's defaults."""
    options: dict[str, Any] = dict(settings.backend_opts)
    if settings.device:
        if "device" not in accepted:
            raise SettingsError(
                f"device={settings.device!r}: the {settings.backend} backend cannot be placed "
                "on a device by lmqueue (--device is for hf and sgl; vllm takes engine_opts)"
            )
        options.setdefault("device", settings.device)
    if settings.adapters and "adapter_paths" in accepted:  # sized for its adapters at start
        options.setdefault("adapter_paths", sorted(settings.adapters.values()))
    if "max_batch_tokens" in accepted:  # a backend that forms its own batches
        options.setdefault("batch_size", settings.batch_size)
        options.setdefault("max_batch_tokens", settings.max_batch_tokens)
        if "timeout" not in options:  # genlm's name for it, if the options use it
            options.setdefault("max_wait_s", settings.max_wait_ms / 1000)
    return options


def batching_for_device(settings: WorkerSettings) -> WorkerSettings:
    """`settings` with the GPU's batch limits (``gpu_batch_size``, ``gpu_max_batch_tokens``)
    when an hf backend will put its model on a GPU (``--device cuda...``, or none and CUDA is
    there): one forward then holds a whole SMC step of hundreds of rows, not 32."""
    if settings.backend != "hf":
        return settings
    if settings.device:
        on_gpu = settings.device.startswith("cuda")
    else:
        import torch

        on_gpu = torch.cuda.is_available()
    if not on_gpu:
        return settings
    return replace(
        settings, batch_size=settings.gpu_batch_size, max_batch_tokens=settings.gpu_max_batch_tokens
    )


def one_torch_team(settings: WorkerSettings) -> WorkerSettings:
    """Call on the worker's main thread before anything runs torch: a backend with a forward
    thread of its own gets this process's torch intra-op threads (``OMP_NUM_THREADS``, else
    the cores) there, and this thread, the loader's and the rest one each.

    With OpenMP every thread that runs a parallel op keeps a team of its own; with more team
    threads than cores libgomp spins 100 times instead of 300,000 before sleeping between
    ops, and a forward of many small ops (a LoRA's) pays a wake-up each (the figures:
    BENCHMARKS.md, adapters). With ``parallel_forwards`` the threads are
    split over the forwards (at least one each). Returns `settings` with the count in
    ``backend_opts`` (unless set there already).
    """
    if "forward_threads" not in backend_class(settings.backend).OPTIONS:
        return settings
    import torch

    forwards = max(int(settings.backend_opts.get("parallel_forwards") or 1), 1)
    threads = settings.backend_opts.get("forward_threads") or max(
        torch.get_num_threads() // forwards, 1
    )
    torch.set_num_threads(1)  # this thread's, and the default of threads started from now
    return replace(settings, backend_opts={**settings.backend_opts, "forward_threads": threads})


def load_backend(settings: WorkerSettings) -> AsyncLM:
    """Load `settings.backend` for `settings.model`.

    Blocking (model loading takes seconds); call it before serving or in a thread.

    Raises:
        SettingsError: an option the backend does not accept or cannot honour.
    """
    cls = backend_class(settings.backend)
    options = backend_options(settings, cls.OPTIONS)
    backend: AsyncLM = cls.from_name(settings.model, **options)
    return backend
