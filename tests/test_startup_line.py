"""A worker names its engine, device and dtype in one line once its backend is loaded."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lmqueue.devstack import WorkerProcess
from lmqueue.workers.startup_line import describe_backend, startup_line


@pytest.mark.parametrize(("setting", "loop"), [(None, "uvloop"), ("asyncio", "asyncio")])
def test_a_real_worker_logs_engine_device_dtype_and_event_loop_in_one_line(
    redis_url: str, tmp_path: Path, setting: str | None, loop: str
) -> None:
    env = {"LMQ_EVENT_LOOP": setting} if setting else {}
    name = f"line-{loop}"
    worker = WorkerProcess(
        "smollm2-135m", "mock", redis_url, name, log_dir=tmp_path, env=env
    ).start()
    try:
        deadline = time.monotonic() + 120
        while "loaded smollm2-135m" not in worker.log():
            assert worker.alive and time.monotonic() < deadline, worker.log()
            time.sleep(0.2)
    finally:
        assert worker.stop() == 0
    (line,) = [line for line in worker.log().splitlines() if "loaded smollm2-135m" in line]
    assert f"worker {name} loaded smollm2-135m: engine mock" in line
    assert line.endswith(f"device none, dtype none, revision mock-v1, event loop {loop}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
async def test_an_hf_backend_is_described_by_its_modules_device_and_dtype(
    tiny_model_dir: Path, smol_tokenizer: Any, dtype: torch.dtype
) -> None:
    from transformers import AutoModelForCausalLM

    from lmqueue.workers.backends.hf import AsyncTransformer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype)
    backend = AsyncTransformer(model, smol_tokenizer, revision="dir-x")
    try:
        found = describe_backend(backend)
        line = startup_line("w1", "tiny", backend)
    finally:
        await backend.aclose()
    assert found["engine"].startswith("hf (transformers 5.")
    assert found["device"] == "cpu" and found["dtype"] == str(dtype).removeprefix("torch.")
    build = f"(CUDA {torch.version.cuda})" if torch.version.cuda else "(CPU build)"
    assert found["torch"] == f"torch {torch.__version__} {build}"
    assert line == (
        f"worker w1 loaded tiny: engine {found['engine']}, {found['torch']}, device cpu, "
        f"dtype {found['dtype']}, revision dir-x"
    )


class _EngineBackend:
    """What the line reads of a vllm or sgl backend: its name and published revision."""

    def __init__(self, name: str, revision: str) -> None:
        self.backend_name = name
        self.revision = revision


@pytest.mark.parametrize(
    ("name", "revision", "dtype"),
    [("vllm", "hub-0123+vllm-bfloat16", "bfloat16"), ("sgl", "dir-9+sglang-float16", "float16"),
     ("vllm", "unexpected", "?")],
)  # fmt: skip
def test_an_engine_backends_dtype_is_read_from_its_revision(
    name: str, revision: str, dtype: str
) -> None:
    found = describe_backend(_EngineBackend(name, revision))
    assert found["dtype"] == dtype
    assert found["engine"].startswith("vllm " if name == "vllm" else "sgl (sglang ")
