"""Trie masses through the queue equal the local tries' masses of the same distribution."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from lmqueue.producer import QueueLM, QueueTrie
from lmqueue.shared.errors import BadRequest, UnknownNode, VocabularyMismatch
from lmqueue.shared.lm.trie import ParallelTokenCharacterTrie
from lmqueue.shared.wire import ids_to_bytes
from lmqueue.workers.backends.mock import MockAsyncLM
from lmqueue.workers.masses import TrieMasses
from workers_in_threads import ThreadedWorker


@pytest.fixture(scope="module")
def local_trie(smol_tokenizer):
    backend = MockAsyncLM(smol_tokenizer)
    return ParallelTokenCharacterTrie(backend.byte_vocab)


@pytest.fixture
def backend(smol_tokenizer):
    return MockAsyncLM(smol_tokenizer)


@pytest.fixture
async def queue_trie(backend, any_redis_url):
    served = ThreadedWorker(backend, any_redis_url, masses=TrieMasses(backend.byte_vocab)).start()
    lm = await QueueLM.connect("mock", redis_url=any_redis_url)
    yield await QueueTrie.create(lm)
    await lm.close()
    served.stop()


def _probabilities(backend, prompt):
    return np.exp(backend.logprobs_of(prompt).numpy().astype(np.float64))


async def test_whole_mass_vectors_match_the_local_trie(queue_trie, backend, local_trie):
    prompt = [1, 2, 3]
    expected = local_trie.weight_sum(_probabilities(backend, prompt))
    got = await queue_trie.mass_sum(prompt)
    assert got.shape == (local_trie.num_nodes,)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert got[0] == pytest.approx(1.0, abs=1e-5)


async def test_node_subsets_and_max_match_the_local_trie(queue_trie, backend, local_trie):
    prompt = [7, 8]
    nodes = [0, 5, 17, local_trie.num_nodes - 1]
    probabilities = _probabilities(backend, prompt)
    np.testing.assert_allclose(
        await queue_trie.mass_sum(prompt, nodes=nodes),
        local_trie.weight_sum(probabilities, nodes=nodes),
        rtol=1e-12,
    )
    np.testing.assert_allclose(
        await queue_trie.mass_max(prompt, nodes=nodes),
        local_trie.weight_max(probabilities, nodes=nodes),
        rtol=1e-12,
    )


async def test_children_of_a_prefix_come_back_by_next_byte(queue_trie, backend, local_trie):
    prompt = [19556, 28]
    children = await queue_trie.children_masses(prompt, b" th")
    edges = local_trie.children_of(b" th")
    full = local_trie.weight_sum(_probabilities(backend, prompt))
    assert set(children) == set(edges)
    for key, node in edges.items():
        assert children[key] == pytest.approx(full[node], rel=1e-9)
    assert ord("e") in children


async def test_many_concurrent_mass_requests_are_answered(queue_trie, backend, local_trie):
    prompts = [[5, n] for n in range(40)]
    nodes = list(local_trie.children_of(b"").values())
    results = await asyncio.gather(*(queue_trie.mass_sum(p, nodes=nodes) for p in prompts))
    for prompt, got in zip(prompts[::7], results[::7], strict=True):
        expected = local_trie.weight_sum(_probabilities(backend, prompt), nodes=nodes)
        np.testing.assert_allclose(got, expected, rtol=1e-9)


async def test_unknown_nodes_and_prefixes_fail_before_sending(queue_trie):
    with pytest.raises(UnknownNode):
        await queue_trie.mass_sum([1], nodes=[10**9])
    with pytest.raises(UnknownNode):
        await queue_trie.children_masses([1], b"\xff\xfe\xfd\xfc")
    assert queue_trie.lm.stats["sent"] == 0


async def test_the_worker_refuses_nodes_numbered_over_another_vocabulary(queue_trie):
    with pytest.raises(VocabularyMismatch):
        await queue_trie.lm.request(
            ids_to_bytes([1]), "mass", "float64", mass_op="sum", vocab_digest="0" * 24
        )


async def test_the_worker_checks_node_ids_too(queue_trie):
    with pytest.raises(UnknownNode):
        await queue_trie.lm.request(
            ids_to_bytes([1]), "mass", "float64", mass_op="sum", node_bytes=ids_to_bytes([-3])
        )


async def test_a_worker_without_tries_refuses_mass_requests(backend, redis_url):
    served = ThreadedWorker(backend, redis_url).start()
    try:
        async with await QueueLM.connect("mock", redis_url=redis_url) as lm:
            with pytest.raises(BadRequest, match="no trie mass"):
                await lm.request(ids_to_bytes([1]), "mass", "float32", mass_op="sum")
    finally:
        served.stop()
