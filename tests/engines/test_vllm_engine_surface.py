"""Every private vLLM name the adapter uses, pinned against vLLM 0.32's real classes.

`workers.backends.vllm_engine`'s docstring lists them; an upgrade that moves one fails here,
by name, before anything else does. No engine is started.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import pytest

from lmqueue.workers.backends.engine_imports import VLLM, require


@pytest.fixture(scope="module")
def vllm() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import vllm

        return vllm


def test_the_installed_vllm_is_the_supported_version() -> None:
    assert require(VLLM).startswith("0.32.")


def test_executor_get_class_takes_the_config(vllm: Any) -> None:
    from vllm.v1.executor import Executor

    assert list(inspect.signature(Executor.get_class).parameters) == ["vllm_config"]


def test_parallel_config_names_world_size_and_executor_backend(vllm: Any) -> None:
    from vllm.config import ParallelConfig

    fields = ParallelConfig.__dataclass_fields__
    assert "distributed_executor_backend" in fields
    assert isinstance(inspect.getattr_static(ParallelConfig, "world_size"), property) or (
        "world_size" in fields
    )


def test_llm_engine_has_engine_core_with_shutdown(vllm: Any) -> None:
    from vllm.v1.engine.core_client import InprocClient

    assert vllm.LLMEngine.__module__ == "vllm.v1.engine.llm_engine"
    source = inspect.getsource(vllm.LLMEngine.__init__)
    assert "self.engine_core = EngineCoreClient.make_client(" in source
    assert callable(InprocClient.shutdown)
    init = inspect.signature(vllm.LLMEngine.__init__).parameters
    assert {"vllm_config", "executor_class", "log_stats", "multiprocess_mode"} <= set(init)


def test_parallel_state_teardown_functions_exist(vllm: Any) -> None:
    from vllm.distributed import parallel_state

    assert callable(parallel_state.destroy_model_parallel)
    assert callable(parallel_state.destroy_distributed_environment)


def test_cpu_platform_reads_the_multiprocessing_variable(vllm: Any) -> None:
    from vllm.platforms import cpu

    assert 'os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "1"' in inspect.getsource(cpu)


def test_engine_args_take_the_cpu_defaults(vllm: Any) -> None:
    from lmqueue.workers.backends.vllm_engine import CPU_DEFAULTS, VLLM_DEFAULTS

    fields = vllm.EngineArgs.__dataclass_fields__
    assert set(CPU_DEFAULTS) | set(VLLM_DEFAULTS) <= set(fields)
    assert "logits_processors" in fields


def test_sampling_params_carry_extra_args_and_output_kind(vllm: Any) -> None:
    from vllm.sampling_params import RequestOutputKind

    params = vllm.SamplingParams(
        max_tokens=1,
        temperature=0.0,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
        extra_args={"k": "v"},
    )
    assert params.clone().extra_args == {"k": "v"}


def test_move_directionality_has_swap(vllm: Any) -> None:
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    assert MoveDirectionality.SWAP.name == "SWAP"
    assert {"removed", "added", "moved"} <= set(BatchUpdate.__dataclass_fields__)
