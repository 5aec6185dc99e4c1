"""One SMC program in a process of its own, for ``lmq bench programs``.

``python -m lmqueue.bench.lib.program_runner --side genlm|lmqueue --variant I ...`` loads what its
side needs (genlm: a full model copy in this process; lmqueue: a `QueueLM` client of the
worker at ``--redis-url``), prints ``ready``, waits for a line on stdin, runs the workload of
`lmqueue.bench.lib.workload` on its own prompt variant, and prints one JSON line: its calls, the
seconds they took and the process's peak RSS (VmHWM, loading included: the memory the program
really holds) and, on a GPU, its peak GPU memory (`devices.torch_peaks`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from lmqueue.devstack import kill_process

from . import devices
from .memory_bounds import vm_hwm
from .workload import Workload, bench_prompt

__all__ = ["main", "run_together"]


async def _genlm(args: argparse.Namespace) -> dict[str, Any]:
    from genlm.backend.llm import AsyncTransformer as GenlmTransformer

    from lmqueue.shared.lm.vocab import decode_vocab
    from lmqueue.workers.models import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(args.model)
    knobs = {"batch_size": args.batch_size, "timeout": args.timeout}
    model = load_causal_lm(args.model, devices.load_options(args.device))
    lm = GenlmTransformer(model, tokenizer, **{
        k: v for k, v in knobs.items() if v is not None
    })  # fmt: skip
    workload = _workload(args, tokenizer, decode_vocab(tokenizer)[0])
    lm.cache_kv(workload.prompt)
    return await _timed(workload, lm)


async def _lmqueue(args: argparse.Namespace) -> dict[str, Any]:
    from lmqueue.producer import QueueLM

    connecting = QueueLM.connect(args.model, redis_url=args.redis_url, adapter=args.adapter)
    async with await connecting as lm:
        workload = _workload(args, lm.tokenizer, [bytes(t) for t in lm.byte_vocab])
        await lm.next_token_logprobs_numpy(workload.prompt)  # what cache_kv gives the other side
        figures = await _timed(workload, lm)
        figures["client_stats"] = lm.stats
        return figures


def _workload(args: argparse.Namespace, tokenizer: Any, byte_vocab: Sequence[bytes]) -> Workload:
    """This program's workload: its own prompt variant (no prefix shared with the others)."""
    workload = Workload.for_tokenizer(
        tokenizer, byte_vocab, args.prompt_tokens, particles=args.particles, steps=args.steps,
        seed=args.seed + args.variant,
    )  # fmt: skip
    prompt = bench_prompt(tokenizer, args.prompt_tokens, variant=args.variant)
    return dataclasses.replace(workload, prompt=prompt)


async def _timed(workload: Workload, lm: Any) -> dict[str, Any]:
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    started = time.monotonic()
    result = await workload.run(lm)
    return {"calls": result.calls, "elapsed_s": time.monotonic() - started}


def run_together(
    commands: Sequence[Sequence[str]], timeout_s: float
) -> tuple[list[dict[str, Any]], float]:
    """Start one program per command, wait until all are loaded, start them at once; their
    JSON figures and the seconds until the last one finished."""
    processes = [
        subprocess.Popen(list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for command in commands
    ]
    try:
        for process in processes:  # every program loaded before any starts
            assert process.stdout is not None
            line = process.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"a program did not start: {line!r}")
        started = time.monotonic()
        for process in processes:
            assert process.stdin is not None
            process.stdin.write("go\n")
            process.stdin.flush()
        results = [_result(process, timeout_s) for process in processes]
        return results, time.monotonic() - started
    finally:
        for process in processes:
            kill_process(process)


def _result(process: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    out, _ = process.communicate(timeout=timeout_s)
    if process.returncode != 0:
        raise RuntimeError(f"a program exited with {process.returncode}")
    figures: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return figures


def main(argv: list[str] | None = None) -> int:
    """Run one program; the last line printed is its JSON figures."""
    parser = argparse.ArgumentParser(prog="program_runner")
    parser.add_argument("--side", choices=["genlm", "lmqueue"], required=True)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--redis-url")
    parser.add_argument("--variant", type=int, default=1)
    parser.add_argument("--particles", type=int, default=16)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--adapter", default=None, help="lmqueue side: a LoRA adapter's name")
    devices.add_device_argument(parser)
    parser.add_argument("--batch-size", type=int, help="genlm's batch_size (its default)")
    parser.add_argument("--timeout", type=float, help="genlm's timeout (its default)")
    args = parser.parse_args(argv)
    if args.side == "genlm":  # the client side never imports torch (see QueueLM)
        import torch

        torch.set_num_threads(args.torch_threads)
    run = _genlm if args.side == "genlm" else _lmqueue
    figures = asyncio.run(run(args))
    figures["peak_rss_bytes"] = vm_hwm(os.getpid())
    figures["gpu"] = devices.torch_peaks()
    figures["gpu_in_use_bytes"] = devices.gpu_used_bytes([os.getpid()])
    figures["imported"] = sorted(m for m in ("torch", "transformers") if m in sys.modules)
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
