"""``lmq``: the command line.

lmq worker --backend hf --model smollm2-135m --redis-url redis://...   serve a model
lmq submit "The capital of France is" --top-k 5                       ask once
lmq demo                                                               the whole pipeline
lmq bench {transport,model,scaling,cache,memory,trie}                  benchmarks
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

__all__ = ["main"]


def _submit(args: argparse.Namespace) -> int:
    from producer import QueueLM

    url = args.redis_url or os.environ.get("LMQ_REDIS_URL") or os.environ.get("REDIS_URL")

    async def ask() -> None:
        async with await QueueLM.connect(args.model, redis_url=url) as lm:
            ids = lm.tokenizer.encode(args.text)
            logprobs = await lm.next_token_logprobs(ids)
            values, tokens = logprobs.topk(args.top_k)
            for logprob, token in zip(values.tolist(), tokens.tolist(), strict=True):
                print(f"{2.718281828459045**logprob:8.4f}  {token:6d}  {lm.str_vocab[token]!r}")

    asyncio.run(ask())
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `lmq` parser with one subparser per command."""
    from workers.main import build_parser as worker_parser

    from . import demo

    parser = argparse.ArgumentParser(
        prog="lmq", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    worker_parser(commands.add_parser("worker", help="serve a model from its request stream"))
    submit = commands.add_parser("submit", help="print the most likely next tokens of a text")
    submit.add_argument("text")
    submit.add_argument("--top-k", type=int, default=10)
    submit.add_argument("--model", default="smollm2-135m")
    submit.add_argument("--redis-url", default=None)
    demo.add_arguments(commands.add_parser("demo", help="run the whole pipeline locally"))
    # Its own flags are parsed by lmqueue.bench (see `main`); listed here for `lmq --help`.
    commands.add_parser("bench", help="run a benchmark: lmq bench --help", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `lmq` console script."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        from workers.main import main as worker_main

        return worker_main(argv[1:])
    if argv[:1] == ["bench"]:
        from .bench import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "submit":
        return _submit(args)
    from . import demo

    return demo.run(args)
