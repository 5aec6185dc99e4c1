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
from lmqueue.shared.settings import WorkerSettings

__all__ = ["backend_class", "backend_options", "load_backend", "one_torch_team"]

#: Backend name -> (module, class); modules are imported only when their backend is used.
_CLASSES = {
    "mock": ("lmqueue.workers.backends.mock", "MockAsyncLM"),
    "hf": ("lmqueue.workers.backends.hf", "AsyncTransformer"),
    "vllm": ("lmqueue.workers.backends.vllm", "AsyncVirtualLM"),
    "sgl": ("lmqueue.workers.backends.sgl", "AsyncSGLTransformer"),
}


def backend_class(name: str) -> Any:
    """The class of backend `name` (its engine is imported only by `from_name`)."""
    if name not in _CLASSES:
        raise SettingsError(f"backend={name!r}: expected one of {', '.join(_CLASSES)}")
    module, attribute = _CLASSES[name]
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
        options.setdefault("timeout", settings.max_wait_ms / 1000)
    return options


def one_torch_team(settings: WorkerSettings) -> WorkerSettings:
    """Call on the worker's main thread before anything runs torch: a backend with a forward
    thread of its own gets this process's torch intra-op threads (``OMP_NUM_THREADS``, else
    the cores) there, and this thread, the loader's and the rest one each.

    With OpenMP every thread that runs a parallel op keeps a team of its own; with more team
    threads than cores libgomp spins 100 times instead of 300,000 before sleeping between
    ops, and a forward of many small ops (a LoRA's) pays a wake-up each: SmolLM2-135M, 32
    rows on 2 threads, 212-248 ms on the forward thread behind the loader's team against
    ~150 ms as the only team (measured here). With ``parallel_forwards`` the threads are
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
