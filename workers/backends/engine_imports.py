"""The one module that imports vLLM or SGLang: lazily, checked, and only to build an engine.

The rest of lmqueue installs and runs without them: nothing here imports an engine at module
level. `import_engine` names the extra to install when a package is absent and refuses a
version outside the pinned range, because both backends are written against that version's
classes (vLLM 0.26's logits-processor interface and v1 ``LLMEngine``; SGLang 0.5.17's
in-process ``Scheduler``). `build_vllm_engine` and `build_sgl_engine` return plain handles, so
the backends themselves (and their tests, with fakes) never import an engine.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from lmqueue.shared.errors import BadRequest, ModelError

from .vllm_logits import TAG_KEY, RowSink, capture_processor_class

__all__ = [
    "EngineSpec",
    "MissingEngine",
    "VLLM",
    "SGLANG",
    "installed_version",
    "require",
    "import_engine",
    "VLLMEngine",
    "build_vllm_engine",
    "VLLM_DEFAULTS",
    "SGLEngine",
    "build_sgl_engine",
    "SGL_DEFAULTS",
]


class MissingEngine(ImportError):
    """Raised when a backend's engine package is absent or outside the supported versions."""


@dataclass(frozen=True)
class EngineSpec:
    """An optional engine: its distribution, the supported versions and lmqueue's extra."""

    distribution: str
    versions: str
    extra: str

    @property
    def install_hint(self) -> str:
        """The command that installs the supported version."""
        return f"pip install 'lmqueue[{self.extra}]'"


#: Kept equal to the ``vllm`` and ``sgl`` extras in pyproject.toml.
VLLM = EngineSpec("vllm", ">=0.26,<0.27", "vllm")
SGLANG = EngineSpec("sglang", ">=0.5.17,<0.5.18", "sgl")


def installed_version(spec: EngineSpec) -> str | None:
    """The installed version of `spec`'s distribution, or None when it is not installed."""
    try:
        return importlib.metadata.version(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def require(spec: EngineSpec) -> str:
    """The installed version of `spec`'s engine, checked against the supported range.

    Raises:
        MissingEngine: it is not installed, or its version is outside ``spec.versions``.
    """
    version = installed_version(spec)
    if version is None:
        raise MissingEngine(
            f"this backend needs {spec.distribution}{spec.versions}, which is not installed: "
            f"{spec.install_hint}",
            name=spec.distribution,
        )
    if Version(version) not in SpecifierSet(spec.versions):
        raise MissingEngine(
            f"{spec.distribution} {version} is installed, but this backend supports "
            f"{spec.distribution}{spec.versions}: {spec.install_hint}",
            name=spec.distribution,
        )
    return version


def import_engine(spec: EngineSpec, module: str) -> ModuleType:
    """Import `module` of an optional engine after `require` has checked the installed version.

    Raises:
        MissingEngine: as `require`, or when `module` fails to import (the message names the
            cause and the extra to install).
    """
    version = require(spec)
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingEngine(
            f"{spec.distribution} {version} is installed but {module} failed to import "
            f"({exc}); reinstall with {spec.install_hint}",
            name=module,
        ) from exc


# -- vLLM --------------------------------------------------------------------------------------
#: EngineArgs defaults; `engine_opts` override them.
VLLM_DEFAULTS: dict[str, Any] = {
    "enable_prefix_caching": True,
    "disable_log_stats": True,
    "gpu_memory_utilization": 0.9,
}


@dataclass(frozen=True)
class VLLMEngine:
    """An in-process vLLM engine whose capture processor writes to `sink`."""

    engine: Any  # vllm.v1.engine.llm_engine.LLMEngine: add_request, step, abort_request, ...
    sink: RowSink
    sampling_params: Callable[[str], Any]  # tag -> SamplingParams that flag the request
    vector_size: int
    max_prompt_tokens: int
    revision: str
    shutdown: Callable[[], None]


def build_vllm_engine(model: str, engine_opts: dict[str, Any] | None = None) -> VLLMEngine:
    """Start vLLM's v1 engine on `model` (a directory or hub id) with the capture processor.

    In this process (``multiprocess_mode=False``) and on the single-GPU ``uni`` executor: the
    processor runs inside vLLM's model runner and must reach the backend's `RowSink`.

    Raises:
        MissingEngine: vLLM is absent or not a supported version.
        BadRequest: `engine_opts` ask for more than one GPU or another executor.
        ModelError: vLLM started without the processor (e.g. ``VLLM_USE_V2_MODEL_RUNNER=1``).
    """
    base = import_engine(VLLM, "vllm.v1.sample.logits_processor").LogitsProcessor
    vllm = import_engine(VLLM, "vllm")
    executor = import_engine(VLLM, "vllm.v1.executor").Executor
    llm_engine = import_engine(VLLM, "vllm.v1.engine.llm_engine").LLMEngine
    final_only = import_engine(VLLM, "vllm.sampling_params").RequestOutputKind.FINAL_ONLY
    parallel = import_engine(VLLM, "vllm.distributed.parallel_state")

    sink = RowSink()
    opts = {**VLLM_DEFAULTS, **(engine_opts or {})}
    processors = [*(opts.get("logits_processors") or []), capture_processor_class(base, sink)]
    config = vllm.EngineArgs(model=model, **{**opts, "logits_processors": processors})
    config = config.create_engine_config()
    workers, backend = (
        config.parallel_config.world_size,
        config.parallel_config.distributed_executor_backend,
    )
    if workers != 1 or backend != "uni":
        raise BadRequest(
            f"AsyncVirtualLM captures logits in this process: it needs one GPU and the 'uni' "
            f"executor, got world size {workers}, executor {backend!r}"
        )
    engine = llm_engine(
        vllm_config=config,
        executor_class=executor.get_class(config),
        log_stats=not opts["disable_log_stats"],
        multiprocess_mode=False,
    )

    def shutdown() -> None:
        engine.engine_core.shutdown()
        parallel.destroy_model_parallel()
        parallel.destroy_distributed_environment()

    if sink.processors == 0:
        shutdown()
        raise ModelError("vLLM started without lmqueue's logits processor; is the V1 runner on?")

    def sampling_params(tag: str) -> Any:
        return vllm.SamplingParams(
            max_tokens=1,
            temperature=0.0,  # greedy: the sampled token is discarded, skip the RNG
            detokenize=False,
            output_kind=final_only,
            extra_args={TAG_KEY: tag},
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
    )


# -- SGLang ------------------------------------------------------------------------------------
#: ServerArgs defaults; `engine_opts` override them.
SGL_DEFAULTS: dict[str, Any] = {
    "sampling_backend": "pytorch",
    "grammar_backend": "none",
    "allow_auto_truncate": False,  # a long prompt must fail, not lose its head
    "disable_overlap_schedule": True,  # the driver is event_loop_normal's, not the overlap loop
    "mem_fraction_static": 0.9,
}


def _nothing() -> None:
    """No process-wide state to release."""


@dataclass(frozen=True)
class SGLEngine:
    """An in-process SGLang ``Scheduler`` and what driving it takes."""

    scheduler: Any  # sglang.srt.managers.scheduler.Scheduler, or a fake with its methods
    make_request: Callable[[str, tuple[int, ...]], Any]  # (rid, ids) -> request object
    revision: str = "unknown"
    gpu_id: int | None = None  # the CUDA device the driving thread must select
    shutdown: Callable[[], None] = _nothing


def build_sgl_engine(model: str, engine_opts: dict[str, Any] | None, gpu_id: int) -> SGLEngine:
    """An SGLang ``Scheduler`` in this process, set up as ``run_scheduler_process`` does.

    Raises:
        MissingEngine: SGLang is absent or not a supported version.
    """
    server_args_mod = import_engine(SGLANG, "sglang.srt.server_args")
    scheduler_mod = import_engine(SGLANG, "sglang.srt.managers.scheduler")
    runtime = import_engine(SGLANG, "sglang.srt.runtime_context")
    utils = import_engine(SGLANG, "sglang.srt.utils")
    envs = import_engine(SGLANG, "sglang.srt.environ").envs
    parallel = import_engine(SGLANG, "sglang.srt.distributed.parallel_state")

    server_args = server_args_mod.ServerArgs(
        **{**SGL_DEFAULTS, "model_path": model, **(engine_opts or {})}
    )
    port_args = server_args_mod.PortArgs.init_new(server_args)
    runtime.publish(server_args, role="scheduler")  # Scheduler.__init__ reads it
    sched = scheduler_mod.Scheduler(
        server_args,
        port_args,
        gpu_id,
        tp_rank=0,
        moe_ep_rank=0,
        pp_rank=0,
        attn_cp_rank=0,
        moe_dp_rank=0,
        dp_rank=None,
    )
    # run_event_loop sets these before its loop; the backend's driver replaces that loop.
    stream = sched.device_module.Stream(priority=0)
    for _ in range(64):  # a schedule stream aliasing the forward stream loses overlap
        if getattr(stream, "cuda_stream", None) != getattr(sched.forward_stream, "cuda_stream", 0):
            break
        stream = sched.device_module.Stream(priority=0)
    sched.schedule_stream = stream
    sched._war_barrier_enabled = utils.is_cuda() or envs.SGLANG_ENABLE_WAR_BARRIER.get()
    # Outputs normally go to a detokenizer process over ZMQ; none runs here, and the PUSH
    # sockets (SNDHWM 0: unbounded) would queue every result forever. Closed and dropped,
    # SenderWrapper sends nothing.
    for sender in (sched.ipc_channels.send_to_detokenizer, sched.ipc_channels.send_to_tokenizer):
        if sender.socket is not None:
            sender.socket.close(linger=0)
            sender.socket = None

    def shutdown() -> None:
        parallel.destroy_model_parallel()
        parallel.destroy_distributed_environment()

    return SGLEngine(
        scheduler=sched,
        make_request=_sgl_request_factory(),
        revision=f"sglang-{sched.model_config.dtype}".replace("torch.", ""),
        gpu_id=gpu_id,
        shutdown=shutdown,
    )


def _sgl_request_factory() -> Callable[[str, tuple[int, ...]], Any]:
    """SGLang's request for a prefill-only prompt, as its tokenizer manager would build it."""
    io_struct = import_engine(SGLANG, "sglang.srt.managers.io_struct")
    sampling = import_engine(SGLANG, "sglang.srt.sampling.sampling_params")

    def make(rid: str, ids: tuple[int, ...]) -> Any:
        params = sampling.SamplingParams(max_new_tokens=0)  # prefill only: nothing sampled
        params.normalize(None)  # no stop strings to encode
        return io_struct.TokenizedGenerateReqInput(
            input_text="",
            input_ids=array("q", ids),  # the scheduler appends to it as an int64 array
            input_embeds=None,
            mm_inputs=None,
            token_type_ids=None,
            sampling_params=params,
            return_logprob=False,
            logprob_start_len=-1,
            top_logprobs_num=0,
            token_ids_logprob=None,
            stream=False,
            rid=rid,
        )

    return make
