"""The SMC workload of the model and memory benchmarks: `run_smc` on a fixed prompt.

Every side of a comparison runs the same sampler with the same prompt, seed, constraint (a
lipogram: no token may contain "e", which makes weights uneven and so forces resampling, i.e.
duplicated particles and repeated prompts) and sizes. Sampled tokens depend on the backend's
numerics, so the sides may diverge after a few steps; each reports the calls it made.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lmqueue.scheduler.smc_sampler import SMCResult, lipogram_mask, run_smc

__all__ = ["PROMPT_TEXT", "Workload", "bench_prompt", "one_torch_thread", "result_figures"]

PROMPT_TEXT = (
    "The old lighthouse keeper had lived on the island for thirty years. Every evening he "
    "climbed the narrow stairs, trimmed the wick, polished the great lens and watched the ships "
    "pass far out at sea. He kept a journal of the weather, the birds and the boats, and of the "
    "rare visitors who came across on the supply ferry. One autumn a storm cut the island off "
    "for two weeks, and when the ferry finally returned it brought a young woman who said she "
    "had come to study the seabirds. She asked him about the colonies on the northern cliffs, "
    "about the tides and the currents, and about the wreck that lay in the bay. He answered "
    "slowly at first, then told her everything he knew."
)


def bench_prompt(tokenizer: Any, n_tokens: int = 100, variant: int = 0) -> list[int]:
    """The first `n_tokens` tokens of the benchmark text; a `variant` > 0 changes the first ones.

    Variants share no prefix, so a backend cannot reuse one variant's KV for another (the memory
    benchmark uses them to fill the KV cache).
    """
    text = PROMPT_TEXT if variant == 0 else f"Chapter {variant}. {PROMPT_TEXT}"
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if len(ids) < n_tokens:
        raise ValueError(f"the benchmark text has {len(ids)} tokens, fewer than {n_tokens}")
    return ids[:n_tokens]


@dataclass(frozen=True)
class Workload:
    """One SMC configuration, run identically against any ``batch_next_token_logprobs``."""

    prompt: list[int]
    allowed: np.ndarray
    eos_token_ids: Sequence[int]
    particles: int = 16
    steps: int = 24
    seed: int = 0

    @classmethod
    def for_tokenizer(
        cls, tokenizer: Any, byte_vocab: Sequence[bytes], prompt_tokens: int = 100, **sizes: Any
    ) -> Workload:
        """The lipogram workload over `tokenizer`'s vocabulary."""
        eos = getattr(tokenizer, "eos_token_id", None)
        return cls(
            prompt=bench_prompt(tokenizer, prompt_tokens),
            allowed=lipogram_mask(byte_vocab),
            eos_token_ids=[eos] if isinstance(eos, int) else [],
            **sizes,
        )

    async def run(
        self, lm: Any, prompt: list[int] | None = None, seed: int | None = None
    ) -> SMCResult:
        """Run the sampler once against `lm` (another prompt or seed if given)."""
        return await run_smc(
            lm,
            self.prompt if prompt is None else prompt,
            self.particles,
            self.steps,
            allowed=self.allowed,
            eos_token_ids=self.eos_token_ids,
            seed=self.seed if seed is None else seed,
        )


def result_figures(result: SMCResult, cpu_s: dict[str, float] | None = None) -> dict[str, Any]:
    """The figures of one SMC run for a result file, with CPU ms per call of each process."""
    calls = max(result.calls, 1)
    return {
        "calls": result.calls,
        "steps": result.steps,
        "resamples": result.resamples,
        "elapsed_s": round(result.elapsed_s, 3),
        "calls_per_s": round(result.calls_per_s, 2),
        "cpu_ms_per_call": {k: round(v * 1000 / calls, 2) for k, v in (cpu_s or {}).items()},
    }


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run the block with one torch thread, as a client process should (see README).

    The sampler's own tensor work is small; with the default team of threads per core,
    OpenMP's spinning waits take the cores the worker process needs (measured here: 7 calls/s
    with two client threads against 71 with one, on the same run of this workload).
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
