"""``lmq bench forward``: what one forward of the hf backend costs beyond the model's arithmetic.

A model of real depth and tiny width (24 layers of width 64 over SmolLM2's 49,152-token
vocabulary, random weights) makes the FLOPs negligible, so a forward's milliseconds are the
overhead a GPU would pay too: assembling pasts, launching operations, Python. For each
``rows x segments`` point, the backend first builds pasts the way an SMC sampler does (a shared
prompt, then one forward per step, each row one token further: a row's past is a chain of
`segments` trie nodes), then times `repeats` more steps, each one forward of all rows.

Per point it prints the milliseconds of a forward (worst and median of the repeats), the tensor
operations dispatched in the forward thread during one forward (counted by a
``TorchDispatchMode`` entered on that thread; an operation is one aten call, a CUDA graph
replay is one), and on CUDA the share of one forward's wall time the GPU spends in kernels
(torch profiler). The last line says whether the operation count grows with rows or segments:
it must not.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from .lib.report import DEFAULT_OUT_DIR, Report

__all__ = ["add_arguments", "run", "deep_tiny_model"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags."""
    parser.add_argument("--rows", default="8,32,64,128,256", help="rows per forward, a list")
    parser.add_argument("--segments", default="1,8,32", help="past segments per row, a list")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per point")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N; auto: cuda if there")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--tokenizer", default="smollm2-135m", help="alias or directory")
    parser.add_argument(
        "--backend-opts", default="", help="extra AsyncTransformer options, k=v,k=v (ints)"
    )
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)


def deep_tiny_model(tokenizer: Any, layers: int, hidden: int, device: str, dtype: Any) -> Any:
    """A random Llama of `layers` layers of width `hidden` over `tokenizer`'s vocabulary."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()  # type: ignore[call-arg]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the result written to ``<out-dir>/forward.json``."""
    import torch

    from lmqueue.workers.models import load_tokenizer

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    report = Report("forward", {k: str(v) for k, v in vars(args).items()})
    tokenizer = load_tokenizer(args.tokenizer)
    dtype = getattr(torch, args.dtype)
    model = deep_tiny_model(tokenizer, args.layers, args.hidden, device, dtype)
    report.figure("device", device)
    options = _options(args.backend_opts)
    points: dict[str, dict[str, Any]] = {}
    for segments in _ints(args.segments):
        for rows in _ints(args.rows):
            figures = asyncio.run(
                _point(model, tokenizer, rows, segments, args.prompt_tokens, args.repeats,
                       options)
            )  # fmt: skip
            key = f"{rows}x{segments}"
            points[key] = figures
            kernels = figures.get("kernel_share")
            line = (
                f"rows {rows:>4} segments {segments:>3}: {figures['ms_median']:8.2f} ms median, "
                f"{figures['ms_worst']:8.2f} worst; {figures['ops']:>6} ops"
                + (f"; kernels {kernels:.0%} of wall" if kernels is not None else "")
            )
            report.figure(key, figures, line=line)
    ops = [p["ops"] for p in points.values()]
    growth = round(max(ops) / min(ops), 3) if ops and min(ops) else None
    ratios = {"ops_max_over_min": growth}
    summary = (
        f"forward: ops per forward {min(ops)}..{max(ops)} over rows {args.rows} x segments "
        f"{args.segments} (max/min {growth}x; target: independent of rows and segments)"
    )
    return report.finish(ratios, summary, args.out_dir)


async def _point(
    model: Any,
    tokenizer: Any,
    rows: int,
    segments: int,
    prompt_tokens: int,
    repeats: int,
    options: dict[str, Any],
) -> dict[str, Any]:
    """Build `segments`-long pasts for `rows` rows, then time `repeats` forwards of all rows."""
    import torch

    from lmqueue.workers.backends.hf import AsyncTransformer

    vocab = len(tokenizer)
    prompt = [(7 * i + 3) % vocab for i in range(prompt_tokens)]
    steps = segments + repeats + 2
    kv_tokens = prompt_tokens + rows * steps + 64
    opts = {"batch_size": rows, "timeout": 1.0, "max_kv_tokens": kv_tokens, **options}
    lm = AsyncTransformer(model, tokenizer, **opts)
    async with lm:
        lm.cache_kv(prompt)
        paths = [list(prompt) for _ in range(rows)]

        async def step() -> float:
            for b, path in enumerate(paths):
                path.append((b * 131 + len(path) * 17 + 1) % vocab)
            before = lm.stats.forward_s
            await asyncio.gather(*(lm.next_token_logprobs(path) for path in paths))
            return (lm.stats.forward_s - before) * 1000

        for _ in range(segments - 1):  # the prompt is segment 1; each step adds one
            await step()
        times = [await step() for _ in range(repeats)]
        counter = _OpCounter()
        await _on_forward_thread(lm, counter.__enter__)
        try:
            await step()
        finally:
            await _on_forward_thread(lm, lambda: counter.__exit__(None, None, None))
        figures: dict[str, Any] = {
            "ms_median": round(statistics.median(times), 3),
            "ms_worst": round(max(times), 3),
            "ms": [round(t, 3) for t in times],
            "ops": counter.count,
            "top_ops": counter.top(8),
            "all_ops": dict(counter.counts),
        }
        if torch.cuda.is_available() and str(next(model.parameters()).device).startswith("cuda"):
            try:
                figures["kernel_share"] = await _kernel_share(step)
            except Exception as exc:  # the profiler's event API moves between torch releases
                figures["kernel_share_error"] = repr(exc)[:200]
        return figures


async def _on_forward_thread(lm: Any, fn: Any) -> None:
    """Run `fn` on the backend's forward thread (where a dispatch mode must be entered)."""
    await asyncio.get_running_loop().run_in_executor(None, lm.run_on_forward_thread, fn)


async def _kernel_share(step: Any) -> float:
    """Share of one forward's wall time the GPU spends in kernels (torch profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        await step()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - started) * 1e6
    kernel_us = sum(
        event.self_device_time_total
        for event in prof.key_averages()
        if event.device_type == torch.autograd.DeviceType.CUDA
    )
    return round(kernel_us / wall_us, 3)


class _OpCounter:
    """Counts the aten operations dispatched on the thread that entered it."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counts: dict[str, int] = {}
        self.counts = counts
        self._lock = threading.Lock()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func.overloadpacket)
                counts[name] = counts.get(name, 0) + 1
                return func(*args, **(kwargs or {}))

        self._mode = Mode()

    @property
    def count(self) -> int:
        return sum(self.counts.values())

    def top(self, n: int) -> dict[str, int]:
        ranked = sorted(self.counts.items(), key=lambda item: -item[1])[:n]
        return dict(ranked)

    def __enter__(self) -> None:
        self._mode.__enter__()

    def __exit__(self, *exc_info: object) -> None:
        self._mode.__exit__(*exc_info)


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _options(text: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        options[key] = int(value) if value.lstrip("-").isdigit() else value
    return options
