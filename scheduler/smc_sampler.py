"""A small sequential Monte Carlo sampler: the workload lmqueue exists for.

Particles extend a prompt one token at a time. Each step asks the model for every live
particle's next-token distribution (one concurrent batch of calls), weights each particle by
the probability mass its constraint allows, samples an allowed token, and resamples when the
effective sample size collapses, which duplicates particles (and so repeats prompts, which the
caches answer). It runs against anything with ``next_token_logprobs`` (or only
``batch_next_token_logprobs``): a `QueueLM`, or an in-process backend for comparison. The
sampler itself is numpy: with a `QueueLM` it asks for arrays (``next_token_logprobs_numpy``),
so a program built on it never imports torch.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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


def lipogram_mask(byte_vocab: Sequence[bytes], banned: bytes = b"eE") -> np.ndarray:
    """A boolean mask of the tokens whose bytes avoid every byte in `banned`."""
    return np.array([not any(b in token for b in banned) for token in byte_vocab], dtype=bool)


async def run_smc(
    lm: Any,
    prompt: list[int],
    n_particles: int,
    n_steps: int,
    *,
    allowed: Any = None,
    allowed_for: Callable[[list[int]], Any] | None = None,
    eos_token_ids: Sequence[int] = (),
    seed: int = 0,
    on_step: Callable[[int], None] | None = None,
) -> SMCResult:
    """Run `n_steps` of SMC with `n_particles` from `prompt`.

    Args:
        lm: has ``async next_token_logprobs_numpy(list[int])`` or ``next_token_logprobs``
            (a step makes its calls at once), else ``batch_next_token_logprobs[_numpy]``.
        allowed: boolean mask (array or tensor) of the tokens the constraint allows (None: all).
        allowed_for: a mask per particle, from its tokens so far (wins over `allowed`).
        eos_token_ids: tokens that finish a particle.
        on_step: called with the step index after each step (progress bars).
    """
    rng = np.random.default_rng(seed)
    token_rng = np.random.default_rng([seed, 1])  # its own stream: resampling does not shift it
    fetch = _fetcher(lm)
    mask = None if allowed is None else np.asarray(allowed, dtype=bool)
    particles = [Particle() for _ in range(n_particles)]
    calls = resamples = 0
    start = time.perf_counter()
    for step in range(n_steps):
        live = [p for p in particles if not p.done]
        if not live:
            break
        logprobs = await fetch([prompt + p.tokens for p in live])
        calls += len(live)
        if allowed_for is not None:
            mask = np.stack([np.asarray(allowed_for(p.tokens), dtype=bool) for p in live])
        _extend_all(live, logprobs, mask, eos_token_ids, token_rng)
        if _effective_sample_size(particles) < n_particles / 2:
            particles = _resample(particles, rng)
            resamples += 1
        if on_step is not None:
            on_step(step)
    return SMCResult(particles, calls, step + 1, time.perf_counter() - start, resamples)


def _fetcher(lm: Any) -> Callable[[list[list[int]]], Any]:
    """How a step gets `lm`'s rows: its single calls at once (``next_token_logprobs_numpy``,
    else ``next_token_logprobs``), each row as the backend returned it, so no (particles x
    vocabulary) copy is made only to be read once by `_extend_all`; an `lm` with batch calls
    only is asked for the batch."""
    single = getattr(lm, "next_token_logprobs_numpy", None) or getattr(
        lm, "next_token_logprobs", None
    )
    if single is None:
        numpy_call = getattr(lm, "batch_next_token_logprobs_numpy", None)
        if numpy_call is not None:
            return numpy_call

        async def fetch_batch(prompts: list[list[int]]) -> np.ndarray:
            rows = await lm.batch_next_token_logprobs(prompts)
            return np.asarray(rows.cpu() if hasattr(rows, "cpu") else rows, dtype=np.float32)

        return fetch_batch

    async def fetch(prompts: list[list[int]]) -> Any:
        return _host_rows(await asyncio.gather(*(single(p) for p in prompts)))

    return fetch


def _host_rows(rows: list[Any]) -> Any:
    """`rows` as numpy rows on the host: arrays as they are, host tensors as views of their
    memory, device tensors stacked there and copied in one transfer (a 2-D array)."""
    if not rows or isinstance(rows[0], np.ndarray):
        return rows
    if all(getattr(row, "device", None) is None or row.device.type == "cpu" for row in rows):
        # float32 rows are viewed, not copied (`.float()` of a float32 tensor is itself)
        return [row.detach().float().numpy() if hasattr(row, "detach") else row for row in rows]
    import torch  # only a torch backend returns device tensors

    return torch.stack(rows).float().cpu().numpy()


#: Tokens per block of the two-level inverse-CDF draw (`_draw`).
_BLOCK = 512


def _extend_all(
    particles: list[Particle],
    logprobs: Any,
    mask: np.ndarray | None,
    eos_token_ids: Sequence[int],
    rng: np.random.Generator,
) -> None:
    """Weight every particle by its allowed mass, then sample one allowed token for each.

    One step of all particles is a handful of array operations over the ``(particles, vocab)``
    matrix (float32 exponentials, float64 sums), not a float64 cumulative sum a particle: at
    64 particles over a 49,152-token vocabulary the per-particle form cost ~55 ms a step on
    this project's CPU, more than a GPU forward of the same step. The draw is the same
    inverse-CDF draw (one uniform a particle whose mass is not zero, in particle order).

    Args:
        logprobs: a 2-D array, or a sequence of 1-D rows (read in place, never stacked).
        mask: None (all tokens), one boolean mask for every particle, or one a particle (rows
            of a 2-D mask); tokens past a mask's end are disallowed.
    """
    rows = logprobs if isinstance(logprobs, np.ndarray) else list(logprobs)
    width = len(rows[0]) if mask is None else mask.shape[-1]
    probs = np.empty((len(rows), width), dtype=np.float32)
    top = np.empty(len(rows), dtype=np.float32)
    sums = np.empty((len(rows), -(-width // _BLOCK)), dtype=np.float64)
    chunks = _chunks(len(rows), width)
    if len(chunks) == 1:
        _weigh(rows, mask, probs, top, sums, chunks[0])
    else:  # numpy releases the GIL in its loops: the chunks run on as many cores
        list(_threads().map(lambda c: _weigh(rows, mask, probs, top, sums, c), chunks))
    alive = np.isfinite(top)
    cumulative = np.cumsum(sums, axis=1)
    totals = cumulative[alive, -1]
    targets = iter(rng.random(len(totals)) * totals)  # one uniform a particle with mass
    for i, (particle, finite, row_top) in enumerate(zip(particles, alive, top, strict=True)):
        if not finite:
            particle.log_weight = -math.inf
            particle.done = True
            continue
        target = next(targets)
        particle.log_weight += float(row_top) + math.log(cumulative[i, -1])
        token = _draw(probs[i], cumulative[i], target)
        if token in eos_token_ids:
            particle.done = True
        else:
            particle.tokens.append(token)


#: Fewest matrix entries a thread of `_weigh` gets (below it, threads cost more than they save).
_CHUNK_ENTRIES = 1 << 19


def _chunks(count: int, width: int) -> list[slice]:
    """The row ranges `_weigh` runs on, one a thread of `_threads` (one range if small)."""
    parts = max(1, min(_THREADS, count * width // _CHUNK_ENTRIES, count))
    bounds = np.linspace(0, count, parts + 1).astype(int)
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


_THREADS = min(8, os.cpu_count() or 1)
_pool: ThreadPoolExecutor | None = None


def _threads() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="lmq-smc-weigh")
    return _pool


def _weigh(
    rows: np.ndarray | list[Any],
    mask: np.ndarray | None,
    probs: np.ndarray,
    top: np.ndarray,
    sums: np.ndarray,
    part: slice,
) -> None:
    """For the rows in `part`: each row's allowed maximum into `top` (-inf: none allowed), its
    allowed tokens' probabilities relative to it into `probs` (0 where disallowed; 1 at the
    maximum), and their sums over consecutive `_BLOCK` tokens into `sums` (each block summed
    pairwise in float32, the last block possibly shorter)."""
    out, width = probs[part], probs.shape[1]
    own_masks = mask[part] if mask is not None and mask.ndim == 2 else None
    # one 2-D operation over an array's rows; row by row over a sequence (the same reads)
    if isinstance(rows, np.ndarray):
        triples = [(out, rows[part, :width], own_masks)]
    else:
        triples = [
            (out[j], np.asarray(row)[:width], None if own_masks is None else own_masks[j])
            for j, row in enumerate(rows[part])
        ]
    additive = None  # one mask for all: an additive 0 / -inf row
    if mask is not None and own_masks is None:
        additive = np.where(mask, np.float32(0), np.float32(-np.inf))
    for dest, source, own_mask in triples:
        if additive is not None:
            np.add(source, additive, out=dest)
        elif own_mask is not None:
            dest[...] = np.float32(-np.inf)
            np.copyto(dest, source, where=own_mask)
        else:
            np.copyto(dest, source)
    row_top = top[part]
    out.max(axis=1, out=row_top)
    out -= np.where(np.isfinite(row_top), row_top, np.float32(0))[:, None]
    np.exp(out, out=out)
    full = width // _BLOCK * _BLOCK
    row_sums = sums[part]
    row_sums[:, : full // _BLOCK] = out[:, :full].reshape(len(out), -1, _BLOCK).sum(axis=2)
    if full < width:
        row_sums[:, -1] = out[:, full:].sum(axis=1, dtype=np.float64)


def _draw(probs: np.ndarray, cumulative: np.ndarray, target: float) -> int:
    """The token where `probs`' running sum passes `target`: the block first (`cumulative`
    holds the blocks' running sums), then the position inside it. Rounding that puts
    `target` past the end picks the last token with mass, never a disallowed one."""
    block = int(np.searchsorted(cumulative, target, side="right"))
    if block >= len(cumulative):
        return int(np.flatnonzero(probs)[-1])
    start = block * _BLOCK
    before = cumulative[block - 1] if block else 0.0
    inside = np.cumsum(probs[start : start + _BLOCK], dtype=np.float64)
    offset = int(np.searchsorted(inside, target - before, side="right"))
    block_probs = probs[start : start + len(inside)]
    if offset >= len(inside):
        offset = int(np.flatnonzero(block_probs)[-1])
    elif block_probs[offset] == 0:
        offset += int(np.flatnonzero(block_probs[offset:])[0])
    return start + offset


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
