"""Token-character tries over the real SmolLM2 vocabulary (49,152 tokens, ~150k nodes)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch
from test_trie import brute_force, weights_for

from lmqueue.shared.errors import VocabularyMismatch
from lmqueue.shared.lm.trie import (
    AsyncTokenCharacterTrie,
    ParallelTokenCharacterTrie,
    TokenCharacterTrie,
)
from lmqueue.shared.lm.vocab import decode_vocab


@pytest.fixture(scope="module")
def vocab(smol_tokenizer: Any) -> list[Any]:
    """SmolLM2's `Token`s."""
    return decode_vocab(smol_tokenizer)[0]


@pytest.fixture(scope="module")
def words(vocab: list[Any]) -> list[bytes]:
    """SmolLM2's tokens as plain bytes."""
    return [bytes(t) for t in vocab]


@pytest.fixture(scope="module")
def sequential(vocab: list[Any]) -> TokenCharacterTrie:
    return TokenCharacterTrie(vocab)


@pytest.fixture(scope="module")
def parallel(vocab: list[Any]) -> ParallelTokenCharacterTrie:
    return ParallelTokenCharacterTrie(vocab, device="cpu")


@pytest.fixture(scope="module")
def sample_nodes(parallel: ParallelTokenCharacterTrie) -> np.ndarray:
    """The root, its children, and random nodes of every kind and depth."""
    rng = np.random.default_rng(5)
    first_bytes = list(parallel.children_of(b"").values())
    return np.unique(np.concatenate([[0], first_bytes, rng.integers(0, parallel.num_nodes, 150)]))


def test_the_trie_has_a_node_per_distinct_prefix_and_a_leaf_per_token(
    parallel: ParallelTokenCharacterTrie, words: list[bytes]
) -> None:
    prefixes = {w[:i] for w in words for i in range(len(w) + 1)}
    assert parallel.num_nodes == len(prefixes) + len(words)
    assert (parallel.layout.parent[1:] < np.arange(1, parallel.num_nodes)).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sums_match_brute_force_and_the_sequential_trie(
    seed: int,
    sequential: TokenCharacterTrie,
    parallel: ParallelTokenCharacterTrie,
    words: list[bytes],
    sample_nodes: np.ndarray,
) -> None:
    p = weights_for(len(words), 4, seed)
    masses = parallel.batch_weight_sum(p)
    assert masses.shape == (4, parallel.num_nodes) and masses.dtype == np.float64
    np.testing.assert_allclose(masses[:, 0], 1.0, rtol=1e-12)
    reference = brute_force(parallel, words, p, "sum", sample_nodes)
    np.testing.assert_allclose(masses[:, sample_nodes], reference, rtol=1e-9, atol=0)
    np.testing.assert_allclose(sequential.weight_sum(p[2]), masses[2], rtol=1e-12, atol=0)


@pytest.mark.parametrize("seed", [3, 4])
def test_maxima_of_log_probabilities_match_brute_force_and_the_sequential_trie(
    seed: int,
    sequential: TokenCharacterTrie,
    parallel: ParallelTokenCharacterTrie,
    words: list[bytes],
    sample_nodes: np.ndarray,
) -> None:
    lp = weights_for(len(words), 3, seed, log_space=True)
    masses = parallel.batch_weight_max(lp)
    assert (masses < 0).all()
    reference = brute_force(parallel, words, lp, "max", sample_nodes)
    np.testing.assert_array_equal(masses[:, sample_nodes], reference)
    np.testing.assert_array_equal(sequential.weight_max(lp[0]), masses[0])


def test_every_internal_mass_is_the_sum_of_its_childrens(
    parallel: ParallelTokenCharacterTrie, words: list[bytes]
) -> None:
    p = weights_for(len(words), 1, seed=9)[0]
    masses = parallel.weight_sum(p)
    from_children = np.zeros(parallel.num_nodes)
    np.add.at(from_children, parallel.layout.parent[1:], masses[1:])
    internal = parallel.layout.internal
    np.testing.assert_allclose(masses[internal], from_children[internal], rtol=1e-9, atol=0)
    np.testing.assert_array_equal(masses[parallel.layout.leaves], p)


def test_the_children_of_one_prefix_are_served_without_computing_every_node(
    parallel: ParallelTokenCharacterTrie, words: list[bytes]
) -> None:
    p = weights_for(len(words), 2, seed=11)
    children = list(parallel.children_of(b" the").values())
    subset = parallel.batch_weight_sum(p, nodes=children)
    np.testing.assert_allclose(
        subset, parallel.batch_weight_sum(p)[:, children], rtol=1e-12, atol=0
    )
    np.testing.assert_allclose(
        subset, brute_force(parallel, words, p, "sum", children), rtol=1e-9, atol=0
    )


def test_float32_torch_vectors_are_read_as_their_float64_values(
    parallel: ParallelTokenCharacterTrie, words: list[bytes]
) -> None:
    lp = torch.log_softmax(
        torch.randn(2, len(words), generator=torch.Generator().manual_seed(0)), -1
    )
    np.testing.assert_array_equal(
        parallel.batch_weight_max(lp), parallel.batch_weight_max(lp.double().numpy())
    )


def test_a_padded_model_output_must_be_sliced_to_the_vocabulary(
    parallel: ParallelTokenCharacterTrie, words: list[bytes]
) -> None:
    padded = np.zeros(len(words) + 64)
    with pytest.raises(VocabularyMismatch):
        parallel.weight_sum(padded)
    assert parallel.weight_sum(padded[: len(words)]).shape == (parallel.num_nodes,)


async def test_async_calls_give_what_the_bulk_and_sequential_tries_give(
    sequential: TokenCharacterTrie, parallel: ParallelTokenCharacterTrie, words: list[bytes]
) -> None:
    p = weights_for(len(words), 4, seed=12)
    lp = np.log(p[:2])
    async with AsyncTokenCharacterTrie(parallel) as async_trie:
        sums = await asyncio.gather(*(async_trie.mass_sum(row) for row in p))
        maxima = await asyncio.gather(*(async_trie.mass_max(row) for row in lp))
    np.testing.assert_allclose(np.stack(sums), parallel.batch_weight_sum(p), rtol=1e-12, atol=0)
    np.testing.assert_array_equal(maxima[1], sequential.weight_max(lp[1]))
