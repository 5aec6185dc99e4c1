"""Backend options: one definition, one `from_name` shape, refusals instead of silence."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from lmqueue.shared.errors import SettingsError
from lmqueue.shared.settings import WorkerSettings
from lmqueue.workers.backend_loader import (
    backend_class,
    backend_options,
    load_backend,
    one_torch_team,
)
from lmqueue.workers.backends.hf import AsyncTransformer

ROOT = Path(__file__).resolve().parent.parent
NAMES = ("mock", "hf", "vllm", "sgl")


@pytest.mark.parametrize("name", NAMES)
def test_every_backend_loads_through_one_from_name_shape(name):
    cls = backend_class(name)
    params = list(inspect.signature(cls.from_name).parameters.values())
    assert [p.name for p in params] == ["model", "engine_opts", "options"]
    assert params[1].kind is inspect.Parameter.KEYWORD_ONLY and params[1].default is None
    assert params[2].kind is inspect.Parameter.VAR_KEYWORD
    constructor = set(inspect.signature(cls.__init__).parameters)
    popped_by_from_name = {"device", "bitsandbytes_opts", "capture_slots", "adapter_paths"}
    assert cls.OPTIONS <= constructor | popped_by_from_name, "an option nothing accepts"


def test_the_hf_backend_batches_by_the_workers_defaults():
    worker = WorkerSettings(model="m")
    defaults = inspect.signature(AsyncTransformer.__init__).parameters
    assert defaults["batch_size"].default == worker.batch_size
    assert defaults["max_batch_tokens"].default == worker.max_batch_tokens
    assert defaults["max_wait_s"].default == worker.max_wait_ms / 1000


async def test_the_hf_backend_takes_genlms_timeout_as_its_max_wait(tiny_model_dir: Path) -> None:
    for options, expected in (({"timeout": 0.25}, 0.25), ({"max_wait_s": 0.5}, 0.5)):
        async with AsyncTransformer.from_name(str(tiny_model_dir), **options) as lm:
            assert lm.max_wait_s == expected


def test_worker_settings_become_options_only_for_backends_that_honour_them():
    hf = WorkerSettings(model="m", backend="hf", batch_size=7, device="cpu")
    options = backend_options(hf, AsyncTransformer.OPTIONS)
    assert options == {"device": "cpu", "batch_size": 7, "max_batch_tokens": 8192,
                       "max_wait_s": 0.005}  # fmt: skip
    genlm_named = WorkerSettings(model="m", backend="hf", backend_opts={"timeout": 0.1})
    assert "max_wait_s" not in backend_options(genlm_named, AsyncTransformer.OPTIONS)
    mock = WorkerSettings(model="m", backend="mock", backend_opts={"batch_delay_s": 0.1})
    assert backend_options(mock, backend_class("mock").OPTIONS) == {"batch_delay_s": 0.1}


def test_only_a_backend_sized_for_its_adapters_at_start_is_given_their_directories():
    adapters = {"b": "/models/b", "a": "/models/a"}
    vllm = WorkerSettings(model="m", backend="vllm", adapters=adapters)
    options = backend_options(vllm, backend_class("vllm").OPTIONS)
    assert options == {"adapter_paths": ["/models/a", "/models/b"]}
    hf = WorkerSettings(model="m", backend="hf", adapters=adapters)
    assert "adapter_paths" not in backend_options(hf, AsyncTransformer.OPTIONS)


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        (dict(backend="mock", device="cuda:0"), "cannot be placed on a device"),
        (dict(backend="vllm", device="cuda:1"), "cannot be placed on a device"),
        (dict(backend="mock", backend_opts={"typo_s": 1}), "does not accept option(s) typo_s"),
        (dict(backend="mock", backend_opts={"engine_opts": {"x": 1}}), "has no engine"),
        (dict(backend="vllm", backend_opts={"batch_delay_s": 1}), "batch_delay_s"),
        (dict(backend="sgl", device="tpu"), "expected cuda:N"),
    ],
)
def test_options_a_backend_cannot_honour_are_refused_before_loading(settings, says):
    with pytest.raises(SettingsError, match=re.escape(says)):
        load_backend(WorkerSettings(model="smollm2-135m", **settings))


def test_the_environment_is_read_only_by_shared_settings():
    """A guard: configuration has one path (``from_env``); nothing else looks at os.environ."""
    readers = []
    for package in ("shared", "producer", "workers", "lmqueue"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            if re.search(r"os\.environ\b|os\.getenv\b|getenv\(", text):
                readers.append(str(path.relative_to(ROOT)))
    assert sorted(readers) == [
        # the plain-vLLM child of ``lmq bench engines`` configures vLLM the way the backend does
        "lmqueue/bench/lib/plain_vllm.py",
        # the child-process launcher passes the environment on to its children; reads no setting
        "lmqueue/devstack/process.py",
        "shared/settings.py",
        # sets vLLM's own variables before vLLM reads them (its executor and OpenMP threads,
        # keeping an OMP_NUM_THREADS the operator chose): engine configuration, not lmqueue's
        "workers/backends/vllm_engine.py",
    ]


def test_a_forward_thread_gets_the_torch_threads_and_every_other_thread_one(
    tiny_model_dir: Path,
) -> None:
    """One OpenMP team in a worker: the forward thread's (see `one_torch_team`). Run in a
    thread of its own: the count is per thread, and the test's thread keeps its own."""
    import threading

    import torch

    seen: dict[str, object] = {}

    def worker_main() -> None:
        torch.set_num_threads(2)  # as OMP_NUM_THREADS=2 would
        settings = one_torch_team(WorkerSettings(model=str(tiny_model_dir), backend="hf"))
        seen["main"] = torch.get_num_threads()
        seen["opts"] = dict(settings.backend_opts)
        backend = load_backend(settings)
        seen["forward"] = backend._executor.submit(torch.get_num_threads).result()
        backend._executor.shutdown()
        mock = WorkerSettings(model="m", backend="mock")
        seen["mock_unchanged"] = one_torch_team(mock) is mock

    thread = threading.Thread(target=worker_main)
    thread.start()
    thread.join(120)
    assert seen == {"main": 1, "opts": {"forward_threads": 2}, "forward": 2,
                    "mock_unchanged": True}  # fmt: skip


def test_parallel_forwards_split_the_torch_threads(tiny_model_dir: Path) -> None:
    """Two forwards at once on two threads: one torch thread each, two executor threads."""
    import threading

    import torch

    seen: dict[str, object] = {}

    def worker_main() -> None:
        torch.set_num_threads(2)
        settings = WorkerSettings(
            model=str(tiny_model_dir), backend="hf", backend_opts={"parallel_forwards": 2}
        )
        settings = one_torch_team(settings)
        seen["opts"] = dict(settings.backend_opts)
        backend = load_backend(settings)
        seen["forwards"] = backend.parallel_forwards
        seen["executor_threads"] = backend._executor._max_workers
        backend._executor.shutdown()

    thread = threading.Thread(target=worker_main)
    thread.start()
    thread.join(120)
    assert seen == {"opts": {"parallel_forwards": 2, "forward_threads": 1}, "forwards": 2,
                    "executor_threads": 2}  # fmt: skip


def test_one_list_names_the_backends() -> None:
    """`BACKENDS` is the only list: the loader, ``--backend`` and the package's names follow it."""
    import lmqueue.workers.backends as backends
    from lmqueue.shared.lm.interface import AsyncLM
    from lmqueue.shared.settings import BACKENDS
    from lmqueue.workers.main import build_parser

    for name, target in BACKENDS.items():
        cls = backend_class(name)
        assert issubclass(cls, AsyncLM) and cls.backend_name == name
        assert getattr(backends, target.split(":")[1]) is cls
        assert cls.__name__ in backends.__all__
    choices = next(a.choices for a in build_parser()._actions if a.dest == "backend")
    assert list(choices) == list(BACKENDS)
    with pytest.raises(SettingsError, match="expected one of hf, mock, vllm, sgl"):
        backend_class("tgi")
