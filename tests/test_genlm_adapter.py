"""Programs written against genlm-backend run on the queue through the adapter.

genlm-control's `PromptedLLM` (a real program built on genlm-backend's `AsyncLM`) computes the
same next-token weights through lmqueue as on genlm-backend's own in-process `AsyncTransformer`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmqueue.producer import QueueLM
from lmqueue.workers.backends.hf import AsyncTransformer
from workers_in_threads import ThreadedWorker

genlm_llm = pytest.importorskip("genlm.backend.llm", reason="needs genlm-backend (dev extra)")
genlm_control = pytest.importorskip("genlm.control", reason="needs genlm-control (dev extra)")
from genlm.backend.tokenization import Token as GenlmToken  # noqa: E402

# genlm-backend 0.3.1, the in-process reference these tests compare with, still calls the model
# with `past_key_values`, which transformers >= 5.24 warns about; lmqueue's own forwards do not
# (tests/test_hf_backend.py runs them with every warning an error).
genlm_past_key_values = pytest.mark.filterwarnings(
    "ignore:`past_key_values` is deprecated:FutureWarning"
)

from lmqueue.producer.genlm_adapter import as_genlm  # noqa: E402


@pytest.fixture
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
async def queue_lm(tiny, redis_url):
    model, tokenizer = tiny
    backend = AsyncTransformer(model, tokenizer, revision="tiny")
    served = ThreadedWorker(backend, redis_url, model="tiny").start()
    lm = await QueueLM.connect("tiny", redis_url=redis_url)
    yield lm
    await lm.close()
    served.stop()


async def test_the_adapter_hands_out_genlm_tokens(queue_lm):
    adapted = as_genlm(queue_lm)
    assert isinstance(adapted, genlm_llm.AsyncLM)
    assert all(isinstance(t, GenlmToken) for t in adapted.byte_vocab[:100])
    assert [bytes(t) for t in adapted.byte_vocab] == [bytes(t) for t in queue_lm.byte_vocab]


@genlm_past_key_values
async def test_prompted_llm_weights_match_genlm_backend_in_process(queue_lm, tiny):
    model, tokenizer = tiny
    reference = genlm_llm.AsyncTransformer(model, tokenizer)
    prompt = tokenizer.encode("Once upon a time, there was")
    ours = genlm_control.PromptedLLM(as_genlm(queue_lm), prompt_ids=prompt)
    theirs = genlm_control.PromptedLLM(reference, prompt_ids=prompt)
    context = ours.tokenize(" a small cat")
    ours_next = await ours.logw_next(context)
    theirs_next = await theirs.logw_next(context)
    np.testing.assert_allclose(ours_next.weights, theirs_next.weights, atol=1e-4)
    ours_lp = await ours.log_probability(context)
    theirs_lp = await theirs.log_probability(context)
    assert ours_lp == pytest.approx(theirs_lp, abs=1e-3)


@genlm_past_key_values
async def test_batched_and_sync_calls_pass_through(queue_lm, tiny):
    model, tokenizer = tiny
    adapted = as_genlm(queue_lm)
    reference = genlm_llm.AsyncTransformer(model, tokenizer)
    prompts = [tokenizer.encode("hello there"), tokenizer.encode("good night")]
    batch = await adapted.batch_next_token_logprobs(prompts)
    expected = torch.stack([reference.next_token_logprobs_uncached(p) for p in prompts])
    assert torch.allclose(batch, expected, atol=1e-4)
    single = adapted.next_token_logprobs_sync(prompts[0])
    assert torch.allclose(single, expected[0], atol=1e-4)
