"""The GPU forward path, measured in one run on a GPU machine (issue: a forward path built for
GPUs). Prints one JSON line per figure and writes ``$OUT/forward_check.json`` as it goes, so
a run cut short still returns what it measured.

Parts (``PARTS``, comma-separated; all by default), in this order:

* ``parity``: a random model of SmolLM2-135M's shape in float32; 24 prompts (shared prefixes,
  siblings, lengths 1..300) and an SMC-shaped run (particles resampled, one token a step) through
  the hf backend's batch entry point, each row against a plain forward; with CUDA graphs and
  without (eager), and whether the graphs were captured and replayed;
* ``save``: only the 1.7B-shaped model saved to disk, for ``queue``/``programs`` without ``smc``;
* ``tohost``: a forward's output (64 or 256 rows of the vocabulary, float32) to the host three
  ways, the last 16 kept alive as the result cache keeps its rows: a fresh pinned buffer
  (`to_host`), a pageable copy, a reused pinned staging buffer cloned out;
* ``smc``: the SMC workload of ``lmq bench model`` (64 particles x 24 steps, lipogram) on a random
  model of SmolLM2-1.7B's shape in bfloat16, in this process: genlm-backend at batch 64 (its best
  grid point on the H200 baseline) against lmqueue's backend with graphs and eager, each built
  once, interleaved over rounds, with today's sampler and (unless ``LEGACY=0``) the per-particle
  sampler it replaced (`legacy_extend_all`); calls/s, ms per forward and its share of the wall
  time, peak GPU memory above the model, and one profiled run each for the share of wall time
  in kernels;
* ``queue``: ``lmq bench model`` with one worker process (the model saved to disk first),
  ``REPEATS`` rounds (3) against genlm's full grid, after its warm-up round;
* ``lockstep``: ``smc_lockstep.py`` (beside this script): the queue's cost to a lock-step
  64 x 24 program through one mock worker whose answers cost nothing;
* ``profile``: py-spy (``bin/py-spy`` beside this script) over the in-process lmqueue side of
  ``smc`` in a child process, summarized per thread (forward thread, sampler, event loop);
* ``forward``: ``lmq bench forward`` on the device (24 layers of width 64: overhead, not FLOPs);
* ``transport``: ``lmq bench transport`` on the machine's cores (vectors of the tokenizer's size;
  skipped if ``BUDGET_S`` leaves under a minute);
* ``programs``: ``lmq bench programs`` K=4 (32 particles x 24 steps, genlm at its defaults, as
  ``../shared/gpu``'s baseline): calls/s and GPU memory in use, one worker against four copies
  (shortened or skipped to end by ``BUDGET_S`` seconds after the start, if set).

On a machine without CUDA it runs the same code on the CPU with tiny shapes (``SIZE=tiny``), to
shake the script out before spending device time.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

OUT = Path(os.environ.get("OUT") or "/tmp/gpuout")
OUT.mkdir(parents=True, exist_ok=True)
TOK = os.environ.get("GPU_TOKENIZER", "smollm2-135m")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TINY = DEV == "cpu" or os.environ.get("SIZE") == "tiny"
PARTS = os.environ.get(
    "PARTS", "parity,tohost,smc,profile,forward,queue,lockstep,transport,programs"
).split(",")
REPEATS = os.environ.get("REPEATS", "3")
ROUNDS = int(os.environ.get("ROUNDS", "3"))
#: ``LEGACY=0`` leaves out the `smc` rounds with the per-particle sampler of before 2026-11-27.
LEGACY = os.environ.get("LEGACY", "1") != "0"
#: The wall-clock time by which the run must end (``BUDGET_S`` seconds after start; 0: none):
#: the last part shrinks or is skipped to fit.
DEADLINE = time.time() + float(os.environ["BUDGET_S"]) if os.environ.get("BUDGET_S") else 0.0
RESULTS: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu"}
SHAPES = {
    "smol": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3),
    "big": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                num_attention_heads=32, num_key_value_heads=32),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2),
}  # fmt: skip


def log(**figures: Any) -> None:
    print(json.dumps(figures, default=str), flush=True)
    RESULTS.update(figures)
    (OUT / "forward_check.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def tokenizer() -> Any:
    from lmqueue.workers.models import load_tokenizer

    return load_tokenizer(TOK)


def build(tok: Any, shape: str, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tok), max_position_embeddings=8192, rope_theta=100000.0,
        tie_word_embeddings=True, initializer_range=0.05, **SHAPES["tiny" if TINY else shape],
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(DEV):
        return LlamaForCausalLM(config).to(dtype).eval()


def backend(model: Any, tok: Any, **options: Any) -> Any:
    from lmqueue.workers.backends.hf import AsyncTransformer

    return AsyncTransformer(model, tok, **options)


def plain(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=DEV)).logits[0, -1]
    return torch.log_softmax(logits.float(), -1).cpu()


def diff(model: Any, ids: list[int], row: Any) -> float:
    return float((plain(model, ids) - row).abs().max())


def prompts(tok: Any) -> list[list[int]]:
    text = (
        "The quick brown fox jumps over the lazy dog while the committee debates the budget "
        "for the coming fiscal year, and nobody remembers who proposed the bridge. "
    ) * 8
    ids = tok.encode(text)
    out = [ids[:n] for n in (1, 2, 7, 31, 60, 61, 62, 100, 150, 299)]
    out += [ids[:60] + [t] for t in (17, 42, 1000, 30000)]
    out += [ids[: 60 + k] for k in range(3, 9)]
    return out + [[5] * 40, ids[200:260], ids[:120][::-1], ids[:1] * 3]


async def parity_run(model: Any, tok: Any, graphs: bool) -> dict[str, Any]:
    lm = backend(model, tok, batch_size=256, max_kv_tokens=20_000,
                 graph_positions=32_768 if graphs else 0)  # fmt: skip
    diffs: list[float] = []
    async with lm:
        batch = prompts(tok)
        rows = await lm.logprobs_batch([(None, p) for p in batch])
        diffs += [diff(model, p, r) for p, r in zip(batch, rows, strict=True)]
        rng = random.Random(0)
        paths = [list(batch[7]) for _ in range(16)]  # a 100-token prompt, 16 particles
        for _ in range(10):
            for path in paths:
                path.append(rng.randrange(1, 40000))
            rows = await lm.logprobs_batch([(None, p) for p in paths])
            diffs += [diff(model, p, r) for p, r in zip(paths, rows, strict=True)]
            paths = [list(rng.choice(paths)) for _ in paths]
        g = lm._graphs
        return {"max_abs_diff": max(diffs), "rows": len(diffs),
                "graphs_enabled": bool(g and g.enabled), "replays": g.replays if g else 0,
                "captures": g.captures if g else 0, "forwards": lm.stats.forwards}  # fmt: skip


def part_parity(tok: Any) -> None:
    model = build(tok, "smol", torch.float32)
    for graphs in (True, False):
        try:
            log(**{f"parity_{'graphs' if graphs else 'eager'}": asyncio.run(
                parity_run(model, tok, graphs))})  # fmt: skip
        except Exception as exc:
            log(**{f"parity_{'graphs' if graphs else 'eager'}_error": repr(exc)[:600]})
    del model


def part_forward() -> None:
    rows = "8,64" if TINY else "8,64,256"
    for label, extra in (("graphs", []), ("eager", ["--backend-opts", "graph_positions=0"])):
        cmd = [sys.executable, "-m", "lmqueue.bench", "forward", "--device", DEV,
               "--rows", rows if label == "graphs" else "64,256", "--segments", "1,32",
               "--tokenizer", TOK, "--out-dir", str(OUT / f"forward_{label}"), *extra]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
        lines = [line for line in proc.stdout.splitlines() if "rows" in line or "ops" in line]
        log(
            **{
                f"forward_{label}_rc": proc.returncode,
                f"forward_{label}": lines[-8:],
                f"forward_{label}_err": proc.stderr[-800:] if proc.returncode else "",
            }
        )


def part_tohost() -> None:
    """A forward's output to the host three ways, with the last 16 outputs kept alive as the
    result cache keeps its rows: a fresh pinned buffer each time (`to_host` today), a pageable
    copy (`.cpu()`), and one reused pinned staging buffer cloned into pageable memory."""
    from collections import deque

    from lmqueue.workers.backends.padded_batch import to_host

    if DEV != "cuda":
        return
    staging: dict[tuple[int, ...], torch.Tensor] = {}

    def staged(tensor: torch.Tensor) -> torch.Tensor:
        buffer = staging.get(tuple(tensor.shape))
        if buffer is None:
            buffer = staging[tuple(tensor.shape)] = torch.empty(
                tensor.shape, dtype=tensor.dtype, pin_memory=True
            )
        buffer.copy_(tensor, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return buffer.clone()

    ways = {"pinned_fresh": to_host, "pageable": lambda t: t.cpu(), "pinned_staged": staged}
    logits = torch.randn(64, 49152, device=DEV)
    for rows in (64, 256):
        source = torch.randn(rows, 49152, device=DEV)
        for label, way in ways.items():
            kept: deque[torch.Tensor] = deque(maxlen=16)
            times = []
            for _ in range(40):
                torch.log_softmax(logits, -1)  # the forward's last kernel, queued before
                started = time.perf_counter()
                host = way(torch.log_softmax(source, -1))
                float(host[0, 0])
                times.append(1000 * (time.perf_counter() - started))
                kept.append(host)
            log(**{f"tohost_{label}_{rows}_ms": {"median": round(statistics.median(times[5:]), 3),
                   "worst": round(max(times[5:]), 3), "first": round(times[0], 3)}})  # fmt: skip


def legacy_extend_all(particles: list[Any], logprobs: Any, mask: Any, eos: Any, rng: Any) -> None:
    """The sampler's step as it was before 2026-11-27: one float64 cumulative sum a particle
    (for before/after figures of the same run; the draws are the same definition)."""
    import math

    import numpy as np

    for i, (particle, row) in enumerate(zip(particles, logprobs, strict=True)):
        row_mask = mask if mask is None or mask.ndim == 1 else mask[i]
        if row_mask is not None:
            row = np.where(row_mask, row[: len(row_mask)], -np.inf)
        top = float(np.max(row))
        if not math.isfinite(top):
            particle.log_weight, particle.done = -math.inf, True
            continue
        cumulative = np.cumsum(np.exp(row - top, dtype=np.float64))
        particle.log_weight += top + math.log(cumulative[-1])
        token = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
        token = min(token, len(cumulative) - 1)
        if token in eos:
            particle.done = True
        else:
            particle.tokens.append(token)


def smc_backend(kind: str, model: Any, tok: Any, **options: Any) -> Any:
    if kind == "genlm":
        from genlm.backend.llm import AsyncTransformer as Genlm

        return Genlm(model, tok, **options)
    return backend(model, tok, **options)


async def smc_one(kind: str, lm: Any, workload: Any, profile: bool) -> dict[str, Any]:
    """One run of `workload` on `lm` (built once a side: a user's program keeps its backend;
    the caches are cleared after each run, the captured graphs and allocators stay)."""
    lm.cache_kv(workload.prompt)
    stats_before = None if kind == "genlm" else (lm.stats.forwards, lm.stats.forward_s,
                                                 lm.stats.rows)  # fmt: skip
    if DEV == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if DEV == "cuda" else 0
    share = None
    started = time.perf_counter()
    if profile and DEV == "cuda":
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        with profiler(activities=[ProfilerActivity.CUDA]) as prof:
            result = await workload.run(lm)
            torch.cuda.synchronize()
        wall = time.perf_counter() - started
        kernel_us = sum(e.self_device_time_total for e in prof.key_averages())
        share = round(kernel_us / 1e6 / wall, 3)
    else:
        result = await workload.run(lm)
        wall = time.perf_counter() - started
    figures = {"calls_per_s": round(result.calls / wall, 1), "wall_s": round(wall, 3),
               "peak_mib_above": round((torch.cuda.max_memory_allocated() - base) / 2**20)
               if DEV == "cuda" else 0, "kernel_share": share}  # fmt: skip
    if stats_before is not None:
        stats = lm.stats
        forwards = stats.forwards - stats_before[0]
        figures["ms_per_forward"] = round(1000 * (stats.forward_s - stats_before[1])
                                          / max(forwards, 1), 2)  # fmt: skip
        figures["rows_per_forward"] = round((stats.rows - stats_before[2]) / max(forwards, 1), 1)
        figures["forward_share"] = round((stats.forward_s - stats_before[1]) / wall, 3)
        figures["replays"] = lm._graphs.replays if lm._graphs else 0
        figures["captures"] = lm._graphs.captures if lm._graphs else 0
    lm.clear_cache()
    return figures


SMC_CONFIGS = [
    ("genlm_b64", "genlm", {"timeout": 0.005}),
    ("lmq_graphs", "lmq", {"timeout": 0.005, "max_batch_tokens": 65536}),
    ("lmq_eager", "lmq", {"timeout": 0.005, "max_batch_tokens": 65536, "graph_positions": 0}),
]


async def smc_rounds(model: Any, tok: Any, workload: Any, particles: int) -> None:
    """Every side built once; round -1 warms them up, then ROUNDS rounds with today's sampler
    and ROUNDS with the sampler as it was (`legacy_extend_all`), interleaved side by side;
    the last round, profiled, is in no ratio."""
    import lmqueue.scheduler.smc_sampler as sampler

    current = sampler._extend_all
    lms = {label: smc_backend(kind, model, tok, batch_size=particles, **options)
           for label, kind, options in SMC_CONFIGS}  # fmt: skip
    for label, kind, _ in SMC_CONFIGS:
        if kind == "lmq":
            await lms[label].__aenter__()
    per_s: dict[tuple[str, str], list[float]] = {}
    samplers = ("now", "legacy") if LEGACY else ("now",)
    schedule = [("now", -1)] + [(which, r) for r in range(ROUNDS) for which in samplers]
    schedule.append(("now", ROUNDS))
    for which, round_index in schedule:
        sampler._extend_all = current if which == "now" else legacy_extend_all
        for label, kind, _ in SMC_CONFIGS:
            if which == "legacy" and label == "lmq_eager":
                continue
            try:
                fig = await smc_one(kind, lms[label], workload, round_index == ROUNDS)
            except Exception as exc:
                fig = {"error": repr(exc)[:600]}
            log(**{f"smc_{label}_{which}_r{round_index}": fig})
            if 0 <= round_index < ROUNDS and "calls_per_s" in fig:
                per_s.setdefault((label, which), []).append(fig["calls_per_s"])
    sampler._extend_all = current
    log_ratios(per_s)
    for label, kind, _ in SMC_CONFIGS:
        if kind == "lmq":
            await lms[label].__aexit__(None, None, None)


def log_ratios(per_s: dict[tuple[str, str], list[float]]) -> None:
    """lmqueue over genlm, round by round, for each sampler."""
    for which in ("now", "legacy"):
        for label in ("lmq_graphs", "lmq_eager"):
            ours, theirs = per_s.get((label, which), []), per_s.get(("genlm_b64", which), [])
            ratios = [round(a / b, 3) for a, b in zip(ours, theirs, strict=False) if b]
            if ratios:
                log(**{f"smc_{label}_over_genlm_{which}": {"worst": min(ratios),
                       "median": statistics.median(ratios), "rounds": ratios}})  # fmt: skip


def smc_workload(tok: Any) -> Any:
    from lmqueue.bench.lib.workload import Workload
    from lmqueue.shared.lm.vocab import decode_vocab

    particles, steps = (8, 6) if TINY else (64, 24)
    return Workload.for_tokenizer(tok, decode_vocab(tok)[0], 100, particles=particles,
                                  steps=steps, seed=0)  # fmt: skip


def part_smc(tok: Any) -> None:
    model = build(tok, "big", torch.float32 if TINY else torch.bfloat16)
    workload = smc_workload(tok)
    asyncio.run(smc_rounds(model, tok, workload, workload.particles))
    if not TINY and ("queue" in PARTS or "programs" in PARTS):
        save_big(model, tok)
    del model


def save_big(model: Any, tok: Any) -> None:
    """The 1.7B-shaped model on disk, for the parts that start a worker process."""
    path = Path("/tmp/gpu-models/big")
    model.save_pretrained(path)
    tok.save_pretrained(path)


def part_save(tok: Any) -> None:
    """Only `save_big` (for a run of ``queue``/``programs`` without ``smc``)."""
    if not TINY:
        save_big(build(tok, "big", torch.bfloat16), tok)


async def smc_profiled(model: Any, tok: Any) -> None:
    """The in-process lmqueue side alone (graphs), for a sampling profiler: a warm-up run,
    then ROUNDS runs, each line with its calls/s and forward share."""
    workload = smc_workload(tok)
    lm = backend(model, tok, batch_size=workload.particles, timeout=0.005,
                 max_batch_tokens=65536)  # fmt: skip
    async with lm:
        for index in range(-1, ROUNDS):
            fig = await smc_one("lmq", lm, workload, False)
            print(json.dumps({f"profiled_r{index}": fig}), flush=True)


def part_profile(tok: Any) -> None:
    """py-spy (``.gpu/bin/py-spy``, if there) over this script's `smc_profiled`, summarized per
    thread into ``profile_*`` figures: where the wall time of the in-process SMC goes."""
    spy = Path(__file__).parent / "bin" / "py-spy"
    if not spy.exists():
        log(profile_skipped=f"no {spy}")
        return
    raw = OUT / "smc_profile.raw"
    env = {**os.environ, "PARTS": "smcprofiled"}
    cmd = [str(spy), "record", "-r", "400", "--threads", "--idle", "--nonblocking", "-f", "raw",
           "-o", str(raw), "--", sys.executable, __file__]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    log(profile_rc=proc.returncode,
        profile_out=[line for line in proc.stdout.splitlines() if "profiled_r" in line],
        profile_err=proc.stderr[-600:])  # fmt: skip
    if raw.exists():
        log(**{"profile_summary": summarize(raw, "_compute", "Workload.run", "_run_once")})


def summarize(raw: Path, *keys: str) -> dict[str, Any]:
    """Samples per thread, and each thread's top frames (self and inclusive) during `keys`."""
    from collections import Counter

    threads: Counter[str] = Counter()
    inclusive: dict[str, Counter[str]] = {}
    own: dict[str, Counter[str]] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        thread = frames[0].split("(")[-1].strip("): ")[:40] if frames else "?"
        inside = next((k for k in keys if any(k in f for f in frames)), None)
        threads[f"{thread} {'in ' + inside if inside else 'other'}"] += int(count)
        if inside is None:
            continue
        names = [f.split(" (")[0] + " " + f.rsplit("/", 1)[-1][:48] for f in frames[1:]]
        for name in set(names):
            inclusive.setdefault(inside, Counter())[name] += int(count)
        if names:
            own.setdefault(inside, Counter())[names[-1]] += int(count)
    return {"threads": threads.most_common(12),
            "inclusive": {k: v.most_common(40) for k, v in inclusive.items()},
            "self": {k: v.most_common(30) for k, v in own.items()}}  # fmt: skip


def bench(name: str, args: list[str], timeout: float) -> None:
    """One ``lmq bench`` subcommand with the in-process sides on the GPU (``patch``); its whole
    output goes to ``$OUT/<name>.log``, its tail into the JSON."""
    patch = Path(__file__).parent / "patch"
    env = {**os.environ, "PYTHONPATH": f"{patch}:{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "lmqueue.bench", name, *args, "--out-dir", str(OUT / name)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        out, rc = proc.stdout + "\n--- stderr\n" + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, rc = f"{exc.stdout or ''}\n--- stderr\n{exc.stderr or ''}", "timeout"
    (OUT / f"{name}.log").write_text(str(out))
    log(**{f"{name}_rc": rc, f"{name}_tail": str(out)[-1800:]})


def part_queue() -> None:
    if TINY:
        return
    bench("model", ["--model", "/tmp/gpu-models/big", "--particles", "64", "--steps", "24",
                    "--repeats", REPEATS, "--sides", "genlm,lmqueue"], timeout=260)  # fmt: skip


def part_programs() -> None:
    if TINY:
        return
    left = DEADLINE - time.time() - 15 if DEADLINE else 200
    if left < 60:
        log(programs_skipped=f"{left:.0f} s left of the run's budget")
        return
    args = ["--model", "/tmp/gpu-models/big", "--programs", "4", "--particles", "32",
            "--steps", "24", "--anchor-grid", "defaults"]  # fmt: skip
    bench("programs", args, timeout=min(200, left))


def part_lockstep() -> None:
    """`smc_lockstep.py` (beside this script): the queue's cost to a lock-step 64 x 24 program
    through one mock worker whose vectors cost nothing, on this machine's cores."""
    script = Path(__file__).with_name("smc_lockstep.py")
    proc = subprocess.run([sys.executable, str(script), "--rounds", "5"], capture_output=True,
                          text=True, timeout=150)  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("round", "load"))]
    log(lockstep_rc=proc.returncode, lockstep=lines, lockstep_err=proc.stderr[-800:])


def part_transport() -> None:
    big = Path("/tmp/gpu-models/big")
    left = DEADLINE - time.time() - 15 if DEADLINE else 150
    if left < 60:
        log(transport_skipped=f"{left:.0f} s left of the run's budget")
        return
    bench("transport", ["--model", str(big) if big.exists() else TOK], timeout=min(150, left))


def main() -> None:
    if PARTS == ["smcprofiled"]:  # the child of `part_profile`: prints, writes no JSON
        tok = tokenizer()
        asyncio.run(smc_profiled(build(tok, "big", torch.float32 if TINY else torch.bfloat16), tok))
        return
    log(torch=torch.__version__, parts=PARTS, tiny=TINY)
    tok = tokenizer()
    for part, run in (("parity", lambda: part_parity(tok)), ("save", lambda: part_save(tok)),
                      ("tohost", part_tohost),
                      ("smc", lambda: part_smc(tok)), ("queue", part_queue),
                      ("lockstep", part_lockstep), ("profile", lambda: part_profile(tok)),
                      ("forward", part_forward), ("transport", part_transport),
                      ("programs", part_programs)):  # fmt: skip
        if part in PARTS:
            started = time.time()
            try:
                run()
            except Exception as exc:
                log(**{f"{part}_error": repr(exc)[:800]})
            log(**{f"{part}_s": round(time.time() - started, 1)})
            if DEV == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
