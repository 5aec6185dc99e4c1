"""``lmq demo``: the whole pipeline on one machine, end to end.

Uses the Redis at ``--redis-url`` (or ``LMQ_REDIS_URL``/``REDIS_URL``) if set, else starts a
private redis-server on a free port; starts worker processes for the default model; runs a
constrained multi-particle generation (SMC: no token may contain the letter "e") through the
queue with a progress bar; prints the samples and the throughput; then stops everything it
started. ``--workers 0 --redis-url URL`` starts no worker and samples through the workers a
deployment already runs, with the one URL ``lmq tenant add`` printed (the cache instance, if
separate, is found in the registry).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator

from lmqueue.producer import QueueLM
from lmqueue.scheduler.smc_sampler import SMCResult, lipogram_mask, run_smc
from lmqueue.shared.errors import ModelError, SettingsError, UnknownModel
from lmqueue.shared.failures import configure_logging
from lmqueue.shared.settings import configured_redis_url

from .devstack import LocalRedis, WorkerProcess

__all__ = ["add_arguments", "run"]

DEFAULT_PROMPT = "Write one sentence about a cat who loves the sea."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's flags."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--backend", default="hf", choices=["hf", "mock"])
    parser.add_argument("--workers", type=int, default=1,
                        help="worker processes to start (0: use the deployment's)")  # fmt: skip
    parser.add_argument("--particles", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--redis-url", default=None, help="default: $LMQ_REDIS_URL, else a private server"
    )


@contextlib.contextmanager
def _redis(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    with LocalRedis() as server:
        print(f"started a private redis-server on port {server.port}")
        yield server.url


@contextlib.contextmanager
def _workers(args: argparse.Namespace, url: str) -> Iterator[list[WorkerProcess]]:
    stamp = int(time.time())
    workers = [
        WorkerProcess(
            args.model, args.backend, url, f"demo-{stamp}-{i}", env={"LMQ_LOG_LEVEL": "WARNING"}
        ).start()
        for i in range(args.workers)
    ]
    print(f"started {len(workers)} {args.backend} worker(s) for {args.model}; loading the model...")
    try:
        yield workers
    finally:
        for worker in workers:
            worker.stop()


async def _generate(args: argparse.Namespace, url: str, workers: list[WorkerProcess]) -> None:
    from tqdm import tqdm

    started = time.perf_counter()
    lm = await _connect(args.model, url, workers)
    print(f"model ready after {time.perf_counter() - started:.1f} s")
    async with lm:
        tokenizer = lm.tokenizer
        prompt = _prompt_ids(tokenizer, args.prompt)
        allowed = lipogram_mask(lm.byte_vocab)
        with tqdm(total=args.steps, desc="SMC steps", unit="step") as bar:
            result = await run_smc(
                lm,
                prompt,
                args.particles,
                args.steps,
                allowed=allowed,
                eos_token_ids=lm.info.eos_token_ids,
                seed=args.seed,
                on_step=lambda _: bar.update(1),
            )
        _report(result, tokenizer, lm)


async def _connect(model: str, url: str, workers: list[WorkerProcess]) -> QueueLM:
    """Wait for the first worker to publish the model, failing fast if every worker died."""
    if not workers:  # the deployment's workers: the model is published or it is not
        return await QueueLM.connect(model, redis_url=url)
    while True:
        try:
            return await QueueLM.connect(model, redis_url=url, connect_timeout_s=2.0)
        except UnknownModel:
            if not any(worker.alive for worker in workers):
                logs = "\n".join(worker.log()[-2000:] for worker in workers)
                raise ModelError(f"every worker exited before serving:\n{logs}") from None


def _prompt_ids(tokenizer: object, text: str) -> list[int]:
    template = getattr(tokenizer, "chat_template", None)
    if template:
        messages = [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            messages, add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]
    return list(tokenizer.encode(text))  # type: ignore[attr-defined]


def _report(result: SMCResult, tokenizer: object, lm: QueueLM) -> None:
    print("\nsamples (no token contains the letter 'e'):")
    best = sorted(result.particles, key=lambda p: -p.log_weight)
    seen = set()
    for particle in best:
        text = tokenizer.decode(particle.tokens)  # type: ignore[attr-defined]
        if text in seen:
            continue
        seen.add(text)
        print(f"  [log w {particle.log_weight:8.2f}] {text!r}")
    stats = lm.stats
    print(
        f"\n{result.calls} next-token calls in {result.elapsed_s:.2f} s = "
        f"{result.calls_per_s:.1f} calls/s through the queue "
        f"({result.steps} steps, {len(result.particles)} particles, {result.resamples} resamples; "
        f"{stats['sent']} sent to workers, {stats['cache_hits']} shared-cache hits)"
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit code."""
    import torch

    configure_logging(logging.WARNING, "%(levelname)s %(name)s %(message)s")
    # This process only samples; a team of spinning OpenMP threads would take the cores the
    # worker computes on (see README, "Client processes").
    torch.set_num_threads(1)
    if args.workers < 0 or (args.workers == 0 and not (args.redis_url or configured_redis_url())):
        raise SettingsError("--workers 0 uses a deployment's workers: give its --redis-url")
    with _redis(args.redis_url or configured_redis_url()) as url:
        with _workers(args, url) as workers:
            asyncio.run(_generate(args, url, workers))
    return 0
