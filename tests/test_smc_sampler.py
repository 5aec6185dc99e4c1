"""The SMC sampler's step over all particles at once, against the per-particle definition."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lmqueue.scheduler import smc_sampler
from lmqueue.scheduler.smc_sampler import Particle, _extend_all, run_smc

VOCAB = 49_152 + 37  # SmolLM2's size plus a ragged last block


def _reference(logprobs: np.ndarray, mask: np.ndarray | None, u: float) -> tuple[float, int]:
    """One particle's log-weight increment and token, from float64 cumulative sums (the
    sampler's definition: inverse CDF of the allowed, renormalized distribution at `u`)."""
    row = logprobs.astype(np.float64)
    if mask is not None:
        row = np.where(mask, row[: len(mask)], -np.inf)
    top = row.max()
    cumulative = np.cumsum(np.exp(row - top))
    token = int(np.searchsorted(cumulative, u * cumulative[-1], side="right"))
    return top + math.log(cumulative[-1]), token


def _rows(count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((count, VOCAB)) * 3
    logits[:, rng.integers(0, VOCAB, 40)] += 12  # a few likely tokens, as a model has
    return (logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))).astype(np.float32)


@pytest.mark.parametrize("kind", ["none", "shared", "per_particle"])
def test_one_step_of_all_particles_matches_the_per_particle_definition(kind: str) -> None:
    rows = _rows(64, seed=1)
    rng = np.random.default_rng(7)
    if kind == "none":
        mask = None
    elif kind == "shared":
        mask = rng.random(VOCAB - 5) < 0.3  # shorter than the rows: the rest is disallowed
    else:
        mask = rng.random((64, VOCAB)) < 0.5
    particles = [Particle() for _ in range(64)]
    _extend_all(particles, rows, mask, (), np.random.default_rng(3))
    uniforms = np.random.default_rng(3).random(64)
    agree = 0
    for i, particle in enumerate(particles):
        row_mask = mask if mask is None or mask.ndim == 1 else mask[i]
        weight, token = _reference(rows[i], row_mask, uniforms[i])
        assert particle.log_weight == pytest.approx(weight, abs=1e-5)
        assert row_mask is None or row_mask[particle.tokens[0]]
        agree += particle.tokens == [token]
    # float32 exponentials move a draw only when its uniform falls within ~1e-6 of a boundary
    assert agree >= 63


def test_draws_follow_the_allowed_distribution() -> None:
    vocab = 2_000  # four blocks, the last one short
    probs = np.full(vocab, 1e-9)
    probs[[3, 700, 1_500, vocab - 1]] = [0.1, 0.2, 0.3, 0.4]
    mask = np.ones(vocab, dtype=bool)
    mask[700] = False  # its mass goes to the others, renormalized
    row = np.log(probs / probs.sum()).astype(np.float32)
    particles = [Particle() for _ in range(20_000)]
    _extend_all(
        particles, np.broadcast_to(row, (20_000, vocab)), mask, (), np.random.default_rng(0)
    )
    drawn = np.bincount([p.tokens[0] for p in particles], minlength=vocab)
    assert drawn[700] == 0
    for token, expected in ((3, 0.125), (1_500, 0.375), (vocab - 1, 0.5)):
        assert drawn[token] / 20_000 == pytest.approx(expected, abs=0.015)
    assert particles[0].log_weight == pytest.approx(math.log(0.8), abs=1e-4)


def test_a_particle_with_no_allowed_token_ends_with_zero_weight_and_draws_nothing() -> None:
    rows = _rows(3, seed=2)
    mask = np.ones((3, VOCAB), dtype=bool)
    mask[1] = False
    particles = [Particle() for _ in range(3)]
    _extend_all(particles, rows, mask, (), np.random.default_rng(5))
    assert particles[1].done and particles[1].log_weight == -math.inf and not particles[1].tokens
    # the others drew the first and second uniforms of the stream, in order
    uniforms = np.random.default_rng(5).random(2)
    for particle, i, u in ((particles[0], 0, uniforms[0]), (particles[2], 2, uniforms[1])):
        assert particle.tokens == [_reference(rows[i], None, u)[1]]


def test_an_eos_token_ends_the_particle() -> None:
    row = np.full((1, 1000), -np.inf, dtype=np.float32)
    row[0, 42] = 0.0
    particle = Particle()
    _extend_all([particle], row, None, (42,), np.random.default_rng(0))
    assert particle.done and particle.tokens == [] and particle.log_weight == 0.0


async def test_a_run_never_samples_a_disallowed_token() -> None:
    rows = _rows(8, seed=4)

    class Fixed:
        async def batch_next_token_logprobs(self, prompts: list[list[int]]) -> np.ndarray:
            return rows[: len(prompts)]

    allowed = np.random.default_rng(9).random(VOCAB) < 0.2
    result = await run_smc(Fixed(), [1, 2], 8, 12, allowed=allowed, seed=11)
    assert result.calls == 8 * 12
    assert all(allowed[t] for p in result.particles for t in p.tokens)
    assert all(len(p.tokens) == 12 for p in result.particles)


@pytest.mark.parametrize("kind", ["shared", "per_particle"])
def test_rows_weighed_on_several_threads_equal_rows_weighed_on_one(monkeypatch, kind) -> None:
    rows = _rows(64, seed=6)
    rng = np.random.default_rng(8)
    mask = rng.random(VOCAB) < 0.3 if kind == "shared" else rng.random((64, VOCAB)) < 0.3
    results = []
    for threads in (1, 4):
        monkeypatch.setattr(smc_sampler, "_THREADS", threads)
        particles = [Particle() for _ in range(64)]
        _extend_all(particles, rows, mask, (), np.random.default_rng(1))
        results.append([(p.tokens, p.log_weight) for p in particles])
    assert len(smc_sampler._chunks(64, VOCAB)) == 4
    assert results[0] == results[1]


@pytest.mark.parametrize("kind", ["none", "shared", "per_particle"])
def test_rows_given_one_by_one_weigh_as_the_stacked_array(kind: str) -> None:
    rows = _rows(16, seed=3)
    rng = np.random.default_rng(2)
    mask = {"none": None, "shared": rng.random(VOCAB - 9) < 0.4,
            "per_particle": rng.random((16, VOCAB)) < 0.4}[kind]  # fmt: skip
    results = []
    for given in (rows, list(rows)):
        particles = [Particle() for _ in range(16)]
        _extend_all(particles, given, mask, (), np.random.default_rng(4))
        results.append([(p.tokens, p.log_weight) for p in particles])
    assert results[0] == results[1]


async def test_a_step_asks_an_lm_with_single_calls_for_its_rows_one_by_one() -> None:
    rows = _rows(4, seed=5)
    asked: list[list[int]] = []

    class Single:
        async def next_token_logprobs_numpy(self, prompt: list[int]) -> np.ndarray:
            asked.append(prompt)
            return rows[len(prompt) % 4]

    result = await run_smc(Single(), [1], 4, 3, seed=2)
    assert result.calls == 12 and len(asked) == 12
    assert all(len(p.tokens) == 3 for p in result.particles)


async def test_host_tensors_are_read_in_place_and_half_precision_ones_widened() -> None:
    import torch

    rows = torch.from_numpy(_rows(4, seed=7))
    given = {"float32": rows, "bfloat16": rows.to(torch.bfloat16)}

    class Tensors:
        def __init__(self, dtype: str) -> None:
            self.dtype = dtype

        async def next_token_logprobs(self, prompt: list[int]) -> torch.Tensor:
            return given[self.dtype][len(prompt) % 4]

    for dtype in given:
        result = await run_smc(Tensors(dtype), [1], 4, 2, seed=3)
        assert result.calls == 8 and all(len(p.tokens) == 2 for p in result.particles)
    host = smc_sampler._host_rows([rows[0], rows[1]])
    assert np.shares_memory(host[0], rows.numpy())
