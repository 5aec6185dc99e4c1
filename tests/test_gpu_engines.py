"""The vLLM and SGLang backends on a real GPU, against HuggingFace transformers.

Skipped unless CUDA and the engine's package (at its supported version) are present; run with
``pytest -m gpu tests/test_gpu_engines.py`` on a GPU machine (docs/ENGINES.md). The model is
SmolLM2-135M exported to a HuggingFace directory; prompts longer than the engines' per-step
token budget exercise chunked prefill. The engines run in bfloat16, the reference in float32
on the CPU, so rows are compared by KL divergence: a row given to the wrong prompt is off by
nats, bfloat16 rounding by far less than the bound.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lmqueue.workers.backends.engine_imports import SGLANG, VLLM, EngineSpec, installed_version

SMOL = "smollm2-135m"
VOCAB = 49_152
KL_BOUND = 0.02  # nats


def _engine_ready(spec: EngineSpec) -> bool:
    return torch.cuda.is_available() and installed_version(spec) is not None


needs_vllm = pytest.mark.skipif(
    not _engine_ready(VLLM), reason="needs CUDA and vllm 0.32/0.33 (on CPU: make test-engines)"
)
needs_sglang = pytest.mark.skipif(not _engine_ready(SGLANG), reason="needs CUDA and sglang 0.5.23")
pytestmark = [
    pytest.mark.gpu,
    # The engines' own import-time and start-up warnings are not ours to fix.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    """SmolLM2-135M as a HuggingFace model directory (what both engines load, and what
    ``from_name("smollm2-135m")`` hands them)."""
    from lmqueue.workers.models import hf_directory

    return Path(hf_directory(SMOL))


@pytest.fixture(scope="module")
def prompts(smol_tokenizer: Any) -> list[list[int]]:
    """Short and long prompts (the long ones span several 32-token prefill chunks)."""
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, " * 12,
        "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21",
    ]
    return [smol_tokenizer.encode(text) for text in texts] + [[1], [1, 2]]


@pytest.fixture(scope="module")
def reference(smol_dir: Path, prompts: list[list[int]]) -> dict[tuple[int, ...], torch.Tensor]:
    """float32 next-token log-probabilities from transformers, on the CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    rows = {}
    with torch.no_grad():
        for ids in prompts:
            logits = model(torch.tensor([ids])).logits[0, -1]
            rows[tuple(ids)] = torch.log_softmax(logits, dim=-1)
    return rows


def assert_close_to(row: torch.Tensor, ref: torch.Tensor) -> None:
    assert row.shape == ref.shape == (VOCAB,) and row.dtype == torch.float32
    kl = torch.sum(ref.exp() * (ref - row)).item()
    assert kl < KL_BOUND, f"KL {kl:.4f} nats"
    assert abs(row.exp().sum().item() - 1.0) < 1e-3


@needs_vllm
class TestVLLM:
    @pytest.fixture(scope="class")
    def lm(self, smol_dir: Path) -> Any:
        from lmqueue.workers.backends import AsyncVirtualLM

        opts = {
            "dtype": "bfloat16",
            "gpu_memory_utilization": 0.3,
            "max_model_len": 256,
            "enable_chunked_prefill": True,
            "max_num_batched_tokens": 32,  # prompts over 32 tokens are chunked
            "max_num_seqs": 8,
            "enforce_eager": True,
        }
        backend = AsyncVirtualLM.from_name(str(smol_dir), engine_opts=opts, cache_size=0)
        yield backend
        backend.close()

    def test_limits_come_from_the_engine(self, lm: Any) -> None:
        assert lm.vector_size == VOCAB and lm.max_prompt_tokens == 255
        assert lm.revision.startswith("dir-") and "vllm-bfloat16" in lm.revision

    def test_cuda_runs_model_runner_v2_unless_told_otherwise(self, lm: Any) -> None:
        told_v1 = os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0"
        assert lm._handle.runner == ("v1" if told_v1 else "v2")
        assert lm._handle.sink.processors == 1

    async def test_concurrent_rows_match_transformers(
        self, lm: Any, prompts: list[list[int]], reference: dict
    ) -> None:
        assert max(len(p) for p in prompts) > 32
        batch = prompts * 3
        rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in batch))
        for ids, row in zip(batch, rows, strict=True):
            assert_close_to(row, reference[tuple(ids)])

    def test_the_sync_batch_matches_transformers(
        self, lm: Any, prompts: list[list[int]], reference: dict
    ) -> None:
        rows = lm.batch_next_token_logprobs_sync(prompts)
        for ids, row in zip(prompts, rows, strict=True):
            assert_close_to(row, reference[tuple(ids)])

    async def test_a_prefix_cache_hit_gives_the_same_row(
        self, lm: Any, prompts: list[list[int]]
    ) -> None:
        first = await lm.next_token_logprobs(prompts[2])
        again = await lm.next_token_logprobs(prompts[2])
        torch.testing.assert_close(again, first, atol=2e-2, rtol=0)
        assert await asyncio.to_thread(lm.clear_kv_cache) is True


@needs_sglang
class TestSGLang:
    @pytest.fixture(scope="class")
    def lm(self, smol_dir: Path) -> Any:
        from lmqueue.workers.backends import AsyncSGLTransformer

        opts = {
            "dtype": "bfloat16",
            "mem_fraction_static": 0.3,
            "context_length": 256,
            "chunked_prefill_size": 32,  # prompts over 32 tokens are chunked
            "disable_cuda_graph": True,
        }  # SGLang 0.5.23's ServerArgs names: unverified here (no CUDA)
        backend = AsyncSGLTransformer.from_name(str(smol_dir), engine_opts=opts, cache_size=16)
        yield backend
        asyncio.run(backend.aclose())

    def test_limits_come_from_the_scheduler(self, lm: Any) -> None:
        assert lm.vector_size == VOCAB and 0 < lm.max_prompt_tokens < 256

    async def test_concurrent_rows_match_transformers(
        self, lm: Any, prompts: list[list[int]], reference: dict
    ) -> None:
        assert max(len(p) for p in prompts) > 32
        batch = prompts * 3
        rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in batch))
        for ids, row in zip(batch, rows, strict=True):
            assert_close_to(row, reference[tuple(ids)])

    def test_the_sync_batch_matches_transformers(
        self, lm: Any, prompts: list[list[int]], reference: dict
    ) -> None:
        lm.clear_cache()
        rows = lm.batch_next_token_logprobs_sync(prompts)
        for ids, row in zip(prompts, rows, strict=True):
            assert_close_to(row, reference[tuple(ids)])

    async def test_flushing_the_kv_cache_keeps_rows_right(
        self, lm: Any, prompts: list[list[int]], reference: dict
    ) -> None:
        assert await asyncio.to_thread(lm.clear_kv_cache) is True
        lm.clear_cache()
        assert_close_to(await lm.next_token_logprobs(prompts[0]), reference[tuple(prompts[0])])
