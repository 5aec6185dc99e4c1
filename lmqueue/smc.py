"""A small sequential Monte Carlo sampler: the workload lmqueue exists for.

Particles extend a prompt one token at a time. Each step asks the model for every live
particle's next-token distribution (one concurrent batch of calls), weights each particle by
the probability mass its constraint allows, samples an allowed token, and resamples when the
effective sample size collapses, which duplicates particles (and so repeats prompts, which the
caches answer). It runs against anything with ``batch_next_token_logprobs``: a `QueueLM`, or an
in-process backend for comparison.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["Particle", "SMCResult", "run_smc", "lipogram_mask"]


@dataclass
class Particle:
    """One hypothesis: the tokens generated so far and its log importance weight."""

    tokens: list[int] = field(default_factory=list)
    log_weight: float = 0.0
    done: bool = False


@dataclass
class SMCResult:
    """Final particles and the work it took."""

    particles: list[Particle]
    calls: int
    steps: int
    elapsed_s: float
    resamples: int

    @property
    def calls_per_s(self) -> float:
        """Next-token calls answered per second of wall time."""
        return self.calls / self.elapsed_s if self.elapsed_s else 0.0


def lipogram_mask(byte_vocab: Sequence[bytes], banned: bytes = b"eE") -> torch.Tensor:
    """A boolean mask of the tokens whose bytes avoid every byte in `banned`."""
    return torch.tensor([not any(b in token for b in banned) for token in byte_vocab])


async def run_smc(
    lm: Any,
    prompt: list[int],
    n_particles: int,
    n_steps: int,
    *,
    allowed: torch.Tensor | None = None,
    allowed_for: Callable[[list[int]], torch.Tensor] | None = None,
    eos_token_ids: Sequence[int] = (),
    seed: int = 0,
    on_step: Callable[[int], None] | None = None,
) -> SMCResult:
    """Run `n_steps` of SMC with `n_particles` from `prompt`.

    Args:
        lm: has ``async batch_next_token_logprobs(list[list[int]]) -> Tensor``.
        allowed: mask of tokens the constraint allows (None: all tokens).
        allowed_for: a mask per particle, from its tokens so far (wins over `allowed`).
        eos_token_ids: tokens that finish a particle.
        on_step: called with the step index after each step (progress bars).
    """
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    particles = [Particle() for _ in range(n_particles)]
    calls = resamples = 0
    start = time.perf_counter()
    for step in range(n_steps):
        live = [p for p in particles if not p.done]
        if not live:
            break
        logprobs = await lm.batch_next_token_logprobs([prompt + p.tokens for p in live])
        calls += len(live)
        for particle, row in zip(live, logprobs, strict=True):
            mask = allowed_for(particle.tokens) if allowed_for is not None else allowed
            _extend(particle, row, mask, eos_token_ids, generator)
        if _effective_sample_size(particles) < n_particles / 2:
            particles = _resample(particles, rng)
            resamples += 1
        if on_step is not None:
            on_step(step)
    return SMCResult(particles, calls, step + 1, time.perf_counter() - start, resamples)


def _extend(
    particle: Particle,
    logprobs: torch.Tensor,
    allowed: torch.Tensor | None,
    eos_token_ids: Sequence[int],
    generator: torch.Generator,
) -> None:
    """Weight by the allowed mass, then sample one allowed token."""
    logprobs = logprobs[: len(allowed)] if allowed is not None else logprobs
    if allowed is not None:
        logprobs = logprobs.masked_fill(~allowed, -math.inf)
    log_mass = torch.logsumexp(logprobs, dim=0).item()
    particle.log_weight += log_mass
    if not math.isfinite(log_mass):
        particle.done = True
        return
    token = int(torch.multinomial(torch.exp(logprobs - log_mass), 1, generator=generator))
    if token in eos_token_ids:
        particle.done = True
    else:
        particle.tokens.append(token)


def _effective_sample_size(particles: list[Particle]) -> float:
    weights = np.array([p.log_weight for p in particles])
    if not np.isfinite(weights).any():
        return 0.0
    normalized = np.exp(weights - np.max(weights))
    normalized /= normalized.sum()
    return float(1.0 / np.sum(normalized**2))


def _resample(particles: list[Particle], rng: np.random.Generator) -> list[Particle]:
    """Multinomial resampling; survivors are copied, their weights reset to the average."""
    weights = np.array([p.log_weight for p in particles])
    finite = np.where(np.isfinite(weights), weights, -np.inf)
    top = np.max(finite)
    unnormalized = np.exp(finite - top)
    mean_log_weight = float(top + math.log(unnormalized.sum()) - math.log(len(particles)))
    probs = unnormalized / unnormalized.sum()
    picks = rng.choice(len(particles), size=len(particles), p=probs)
    return [Particle(list(particles[i].tokens), mean_log_weight, particles[i].done) for i in picks]
