"""Token-character tries on small synthetic vocabularies: structure, masses, inputs, errors.

Masses are checked against a brute-force reference that knows nothing of the numbering: a
node's mass is reduced over the vocabulary entries whose bytes start with its prefix (a leaf's
over its one entry).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lmqueue.shared.errors import BadRequest, UnknownNode, VocabularyMismatch
from lmqueue.shared.lm.tokens import Token
from lmqueue.shared.lm.trie import ParallelTokenCharacterTrie, TokenCharacterTrie
from lmqueue.shared.lm.trie.inputs import MAX, SUM
from lmqueue.shared.lm.trie.torch_levels import TorchLevels

# A small alphabet (with UTF-8 continuation bytes and 0xff) forces shared prefixes, duplicates
# and empty entries.
_pieces = st.sampled_from([b"a", b"b", b"\x00", b"\xc3", b"\xa9", b"\xe2\x82\xac", b"\xff"])
words_strategy = st.lists(st.lists(_pieces, max_size=4).map(b"".join), min_size=1, max_size=24)


def brute_force(
    trie: TokenCharacterTrie, words: list[bytes], ws: np.ndarray, op: str, nodes: Any = None
) -> np.ndarray:
    """Masses of `nodes` (default all) from prefix matching alone; rows of `ws` are vectors."""
    reduce = np.sum if op == "sum" else np.max
    ws = np.atleast_2d(ws)
    position_of_leaf = {trie.word2leaf[token]: i for i, token in enumerate(trie.tokens)}
    nodes = range(trie.num_nodes) if nodes is None else nodes
    out = np.empty((len(ws), len(nodes)))
    for column, node in enumerate(nodes):
        if node in position_of_leaf:
            members = [position_of_leaf[node]]
        else:
            prefix = trie.node2prefix[node]
            members = [i for i, w in enumerate(words) if w.startswith(prefix)]
        out[:, column] = reduce(ws[:, members], axis=1)
    return out


def weights_for(n_words: int, rows: int, seed: int, log_space: bool = False) -> np.ndarray:
    """Random weights: peaky probabilities (with tiny masses) or log-probabilities."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(n_words, 0.2), size=rows)
    return np.log(p) if log_space else p


@settings(max_examples=60, deadline=None)
@given(words=words_strategy, seed=st.integers(0, 2**32 - 1))
def test_masses_match_brute_force_for_every_trie_and_both_reductions(
    words: list[bytes], seed: int
) -> None:
    sequential = TokenCharacterTrie(words)
    parallel = ParallelTokenCharacterTrie(words, device="cpu")
    probabilities = weights_for(len(words), 3, seed)
    log_probabilities = weights_for(len(words), 3, seed, log_space=True)
    for trie in (sequential, parallel):
        np.testing.assert_allclose(
            trie.batch_weight_sum(probabilities),
            brute_force(trie, words, probabilities, "sum"),
            rtol=1e-9,
            atol=0,
        )
        np.testing.assert_array_equal(
            trie.batch_weight_max(log_probabilities),
            brute_force(trie, words, log_probabilities, "max"),
        )


@settings(max_examples=40, deadline=None)
@given(
    words=words_strategy,
    data=st.data(),
)
def test_single_rows_batches_and_node_subsets_agree(words: list[bytes], data: Any) -> None:
    trie = ParallelTokenCharacterTrie(words, device="cpu")
    ws = data.draw(
        hnp.arrays(
            np.float64,
            (2, len(words)),
            elements=st.floats(-30, 30, allow_nan=False, allow_subnormal=False),
        )
    )
    nodes = data.draw(st.lists(st.integers(0, trie.num_nodes - 1), max_size=8))
    for op in ("sum", "max"):
        weights = np.exp(ws) if op == "sum" else ws
        batch = getattr(trie, f"batch_weight_{op}")(weights)
        single = getattr(trie, f"weight_{op}")(weights[1])
        np.testing.assert_array_equal(single, batch[1])
        subset = getattr(trie, f"batch_weight_{op}")(weights, nodes=nodes)
        np.testing.assert_allclose(subset, batch[:, nodes], rtol=1e-12)


def test_nodes_are_numbered_topologically_with_every_prefix_once() -> None:
    words = [b"ab", b"a", b"", b"ab", b"b\xff", b"caf\xc3\xa9", b"abc"]
    trie = TokenCharacterTrie(words)
    prefixes = {w[:i] for w in words for i in range(len(w) + 1)}
    assert trie.num_nodes == len(prefixes) + len(words)
    assert trie.node2prefix[trie.root] == b"" and trie.root == 0
    for node, edges in enumerate(trie.children):
        for edge, child in edges.items():
            assert child > node
            if isinstance(edge, tuple):
                assert trie.node2prefix[child] == words[edge[1]]
                assert trie.node2prefix[child] == trie.node2prefix[node]
            else:
                assert trie.node2prefix[child] == trie.node2prefix[node] + bytes([edge])
    assert {trie.node2prefix[trie.node_of(p)] for p in prefixes} == prefixes


def test_equal_byte_strings_and_empty_strings_keep_separate_leaves() -> None:
    words = [b"ab", b"", b"ab", b""]
    trie = TokenCharacterTrie(words)
    leaves = [trie.word2leaf[token] for token in trie.tokens]
    assert len(set(leaves)) == 4
    assert trie.children[trie.root][(None, 1)] == leaves[1]
    assert trie.children[trie.root][(None, 3)] == leaves[3]
    assert trie.children_of(b"ab") == {(None, 0): leaves[0], (None, 2): leaves[2]}
    masses = trie.weight_sum(np.array([1.0, 2.0, 4.0, 8.0]))
    assert masses[trie.root] == 15.0 and masses[trie.node_of(b"ab")] == 5.0


def test_tokens_keep_their_ids_and_plain_bytes_get_their_positions() -> None:
    tokens = [Token(7, b"x"), Token(3, b"x")]
    trie = TokenCharacterTrie(tokens)
    assert trie.word2leaf[tokens[0]] != trie.word2leaf[tokens[1]]
    assert trie.leaf2word[trie.word2leaf[tokens[1]]].token_id == 3
    plain = TokenCharacterTrie([b"x", b"x"])
    assert [t.token_id for t in plain.tokens] == [0, 1]


def test_a_one_token_vocabulary_has_a_root_a_prefix_chain_and_a_leaf() -> None:
    trie = ParallelTokenCharacterTrie([b"\xe2\x82\xac"], device="cpu")
    assert trie.num_nodes == 5
    assert trie.weight_sum(np.array([0.25])).tolist() == [0.25] * 5
    assert trie.weight_max(np.array([-3.0])).tolist() == [-3.0] * 5


def test_max_is_right_for_negative_log_space_weights() -> None:
    trie = TokenCharacterTrie([b"a", b"ab", b"b"])
    masses = trie.weight_max(np.array([-5.0, -2.0, -9.0]))
    assert masses[trie.root] == -2.0
    assert masses[trie.node_of(b"a")] == -2.0
    assert masses[trie.node_of(b"b")] == -9.0


def test_torch_inputs_of_any_float_dtype_give_float64_numpy_results() -> None:
    words = [b"a", b"ab", b"b", b"ba"]
    trie = ParallelTokenCharacterTrie(words, device="cpu")
    ws = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float32)
    result = trie.batch_weight_sum(ws)
    assert isinstance(result, np.ndarray) and result.dtype == np.float64
    np.testing.assert_allclose(result, trie.batch_weight_sum(ws.double().numpy()))
    listed = trie.batch_weight_max([ws[0], ws[0].to(torch.bfloat16)])
    assert listed.shape == (2, trie.num_nodes)


def test_the_torch_engine_matches_numpy_on_cpu() -> None:
    words = [b"a", b"ab", b"", b"ab", b"b\xff\x00", b"ba"]
    trie = ParallelTokenCharacterTrie(words, device="cpu")
    engine = TorchLevels(trie.layout, "cpu")
    p = weights_for(len(words), 4, seed=1)
    lp = np.log(p)
    np.testing.assert_allclose(
        engine.run(torch.from_numpy(p), SUM).numpy(), trie.batch_weight_sum(p), rtol=1e-12
    )
    np.testing.assert_array_equal(
        engine.run(torch.from_numpy(lp), MAX).numpy(), trie.batch_weight_max(lp)
    )


def test_a_parallel_trie_on_the_torch_engine_takes_tensors_lists_and_node_subsets() -> None:
    words = [b"a", b"ab", b"", b"b"]
    trie = ParallelTokenCharacterTrie(words, device="cpu")
    expected = trie.batch_weight_sum(weights_for(len(words), 2, seed=2))
    trie.engine = TorchLevels(trie.layout, "cpu")  # what a CUDA device gets
    p = weights_for(len(words), 2, seed=2)
    np.testing.assert_allclose(trie.batch_weight_sum(torch.from_numpy(p)), expected, rtol=1e-12)
    np.testing.assert_allclose(trie.batch_weight_sum(list(p)), expected, rtol=1e-12)
    np.testing.assert_allclose(trie.weight_sum(p[1], nodes=[0, 2]), expected[1, [0, 2]])
    assert trie.batch_weight_max([]).shape == (0, trie.num_nodes)
    with pytest.raises(VocabularyMismatch):
        trie.weight_max(torch.zeros(len(words) + 1))


@pytest.mark.parametrize("length", [3, 5])
def test_a_vector_of_the_wrong_length_is_a_vocabulary_mismatch(length: int) -> None:
    trie = TokenCharacterTrie([b"a", b"b", b"c", b"d"])
    with pytest.raises(VocabularyMismatch) as caught:
        trie.weight_sum(np.ones(length))
    assert caught.value.data == {"entries": length, "vocab_size": 4}
    with pytest.raises(VocabularyMismatch):
        trie.batch_weight_max(np.ones((2, length)))


def test_arrays_that_are_neither_vectors_nor_batches_are_bad_requests() -> None:
    trie = TokenCharacterTrie([b"a", b"b"])
    with pytest.raises(BadRequest):
        trie.weight_sum(np.ones((1, 1, 2)))


@pytest.mark.parametrize("nodes", [[-1], [99], [0, 1.5], np.array([True])])
def test_unknown_node_ids_are_refused(nodes: Any) -> None:
    trie = TokenCharacterTrie([b"a", b"b"])
    with pytest.raises(UnknownNode):
        trie.weight_sum(np.ones(2), nodes=nodes)


def test_one_node_id_gives_a_length_one_axis_and_batches_stay_batches() -> None:
    trie = TokenCharacterTrie([b"a", b"ab"])
    ws = np.array([[0.25, 0.5], [1.0, 2.0]])
    assert trie.weight_sum(ws[0], nodes=trie.root).tolist() == [0.75]
    assert trie.weight_sum(ws, nodes=[trie.root]).tolist() == [[0.75], [3.0]]
    assert trie.batch_weight_max(ws[0]).shape == (1, trie.num_nodes)


def test_an_unknown_prefix_is_an_unknown_node() -> None:
    trie = TokenCharacterTrie([b"ab"])
    assert trie.node_of(b"a") == 1
    with pytest.raises(UnknownNode):
        trie.children_of(b"b")


def test_bad_vocabularies_are_refused() -> None:
    with pytest.raises(ValueError):
        TokenCharacterTrie([])
    with pytest.raises(TypeError):
        TokenCharacterTrie(["a"])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        TokenCharacterTrie([Token(1, b"a"), Token(1, b"b")])


def test_a_device_other_than_cpu_or_cuda_is_refused() -> None:
    with pytest.raises(ValueError):
        ParallelTokenCharacterTrie([b"a"], device="mps")
