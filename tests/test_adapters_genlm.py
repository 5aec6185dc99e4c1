"""genlm-backend's adapter calls, mapped onto adapters the service serves by name."""

from __future__ import annotations

import numpy as np
import pytest
from test_adapters import PROMPT, fake_adapter

from lmqueue.producer import QueueLM
from lmqueue.shared.errors import UnknownAdapter
from lmqueue.workers.backends.mock import MockAsyncLM
from workers_in_threads import ThreadedWorker

pytest.importorskip("genlm.backend.llm", reason="needs genlm-backend (dev extra)")
from lmqueue.producer.genlm_adapter import as_genlm  # noqa: E402


@pytest.fixture
def backend(smol_tokenizer):
    return MockAsyncLM(smol_tokenizer)


@pytest.fixture
async def genlm(backend, redis_url, tmp_path):
    adapters = {n: str(fake_adapter(tmp_path / n, n.encode())) for n in ("a", "b")}
    worker = ThreadedWorker(backend, redis_url, adapters=adapters).start()
    lm = await QueueLM.connect("mock", redis_url=redis_url, timeout_s=20)
    yield as_genlm(lm)
    await lm.close()
    worker.stop()


def _same(row, backend, name):
    np.testing.assert_array_equal(np.asarray(row), backend.logprobs_of(PROMPT, name).numpy())


async def test_per_call_lora_names_after_add_new_lora_as_in_genlm_backend_0_3(genlm, backend):
    genlm.add_new_lora("/where/the/program/kept/it", "a")
    _same(await genlm.next_token_logprobs(PROMPT, lora_name="a"), backend, "a")
    _same(await genlm.next_token_logprobs(PROMPT), backend, None)
    rows = await genlm.batch_next_token_logprobs([PROMPT, PROMPT], lora_name="a")
    _same(rows[1], backend, "a")


async def test_set_lora_and_clear_lora_switch_later_calls_as_in_earlier_genlm(genlm, backend):
    genlm.set_lora("/path", "b")
    _same(await genlm.next_token_logprobs(PROMPT), backend, "b")
    _same(await genlm.next_token_logprobs(PROMPT, lora_name="a"), backend, "a")
    sampled = await genlm.sample(PROMPT, max_tokens=2, eos_token_ids=[], temperature=1.0)
    assert len(sampled) == 2
    genlm.clear_lora()
    _same(await genlm.next_token_logprobs(PROMPT), backend, None)
    genlm.set_lora(lora_name="a")
    genlm.remove_lora("a")
    _same(await genlm.next_token_logprobs(PROMPT), backend, None)


async def test_an_adapter_the_service_lacks_fails_on_first_use_naming_the_served_ones(genlm):
    genlm.add_new_lora("/local/only", "mine")
    with pytest.raises(UnknownAdapter, match="served: a, b"):
        await genlm.next_token_logprobs(PROMPT, lora_name="mine")
