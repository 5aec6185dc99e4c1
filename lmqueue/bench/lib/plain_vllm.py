"""Plain vLLM asked for full-vocabulary rows the documented way, for ``lmq bench engines``.

Run as a child process (``python -m lmqueue.bench.lib.plain_vllm``, its arguments a JSON object on
stdin, its figures a JSON line on stdout): vLLM's offline ``LLM`` sets process-wide state
(torch's thread count among it) that the benchmark's own process must not inherit.

``LLM(max_logprobs=-1)`` and ``SamplingParams(max_tokens=1, logprobs=-1)`` are how vLLM's
documentation asks for every token's log-probability; each answer is a dict of ``Logprob``
objects, turned here into the float32 row lmqueue's worker returns. The engine gets the same
settings as the worker's (`workers.backends.vllm_engine`: in-process, every core of this
process, float32, eager, 1 GiB of KV cache) so that only the way rows leave vLLM differs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

__all__ = ["run", "main"]


def run(model_dir: str, waves: list[list[list[int]]], warmup: list[int]) -> dict[str, Any]:
    """Load ``LLM`` on `model_dir`, answer each wave of prompts in one ``generate``; figures."""
    import torch

    cores = len(os.sched_getaffinity(0))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in this process, as lmqueue's engine
    os.environ.setdefault("OMP_NUM_THREADS", str(cores))
    torch.set_num_threads(cores)
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(
        model=model_dir,
        max_logprobs=-1,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=1 << 30,
        enable_prefix_caching=True,
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=-1, detokenize=False)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    llm.generate([TokensPrompt(prompt_token_ids=warmup)], params, use_tqdm=False)
    rows: list[list[float]] = []
    started, cpu_started = time.monotonic(), time.process_time()
    for wave in waves:
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in wave], params, use_tqdm=False
        )
        for output in outputs:
            rows.append(_row(output.outputs[0].logprobs[0], vocab))
    elapsed_s, cpu_s = time.monotonic() - started, time.process_time() - cpu_started
    calls = sum(len(wave) for wave in waves)
    return {
        "calls": calls,
        "elapsed_s": round(elapsed_s, 3),
        "calls_per_s": round(calls / elapsed_s, 3),
        "cpu_ms_per_call": round(cpu_s * 1000 / calls, 2),
        "first_row": rows[0],
    }


def _row(logprobs: Any, vocab: int) -> list[float]:
    """A dense row from vLLM's ``{token_id: Logprob}`` answer (every id present)."""
    row = [float("-inf")] * vocab
    for token_id, logprob in logprobs.items():
        if token_id < vocab:
            row[token_id] = logprob.logprob
    return row


def main() -> int:
    """Read the arguments from stdin, print the figures as the last line of stdout."""
    args = json.loads(sys.stdin.read())
    result = run(args["model_dir"], args["waves"], args["warmup"])
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
