"""``lmq``: the command line.

lmq worker --backend hf --model smollm2-135m --redis-url redis://...   serve a model
lmq submit "The capital of France is" --top-k 5  (or -, or --prompt-file F)  ask once
lmq demo                                                               the whole pipeline
lmq scheduler --redis-url redis://...                                  run experiments
lmq experiment {submit,status,list,cancel,results} ...                 manage experiments
lmq bench COMMAND [flags]        (lmq bench --help lists them)         benchmarks
lmq tenant {add,set,list,remove,worker-user}                           tenants and ACL users
lmq adapter {add,list,remove} MODEL ...                                LoRA adapters by name
lmq keda-triggers --model MODEL                                        KEDA triggers per tenant

Every command reports a failure as one line naming the error and what to do, and exits
non-zero (2 for a wrong flag or setting); ``--verbose``, anywhere on the line, adds the
traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from pathlib import Path

from lmqueue.shared.errors import SettingsError
from lmqueue.shared.failures import ArgumentParser, report_failure
from lmqueue.shared.settings import ClientSettings, redis_url_source

from .connection_url import say_default_url

__all__ = ["main", "build_parser"]

_VERBOSE = "--verbose"


def _submit(args: argparse.Namespace) -> int:
    from lmqueue.producer import QueueLM

    text = _prompt_text(args)
    url, source = redis_url_source(args.redis_url)
    settings = ClientSettings.resolve(redis_url=url, cache_url=args.cache_url)
    say_default_url(url, source, "lmq submit")  # once the settings are known to be good

    async def ask() -> None:
        async with await QueueLM.connect(args.model, settings=settings, adapter=args.adapter) as lm:
            ids = lm.tokenizer.encode(text)
            logprobs = await lm.next_token_logprobs(ids)
            values, tokens = logprobs.topk(min(args.top_k, lm.vector_size))
            print(f"{'token':>6}  {'logprob':>9}  {'prob':>7}  text")
            for logprob, token in zip(values.tolist(), tokens.tolist(), strict=True):
                shown = lm.str_vocab[token] if token < len(lm.str_vocab) else ""
                print(f"{token:6d}  {logprob:9.4f}  {math.exp(logprob):7.4f}  {shown!r}")

    asyncio.run(ask())
    return 0


def _prompt_text(args: argparse.Namespace) -> str:
    """The prompt: the argument, standard input for ``-``, or the ``--prompt-file``."""
    if args.prompt_file is not None:
        if args.text is not None:
            raise SettingsError("give the prompt as an argument or --prompt-file, not both")
        return Path(args.prompt_file).read_text(encoding="utf-8")
    if args.text is None:
        raise SettingsError("no prompt: give it as an argument, - for stdin, or --prompt-file")
    return sys.stdin.read() if args.text == "-" else str(args.text)


def build_parser() -> argparse.ArgumentParser:
    """The `lmq` parser with one subparser per command."""
    from lmqueue.scheduler.main import add_arguments as scheduler_arguments
    from lmqueue.workers.main import build_parser as worker_parser

    from . import adapters_cli, demo, experiments_cli, keda_triggers, status, tenants

    parser = ArgumentParser(
        prog="lmq", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(_VERBOSE, action="store_true", help="show tracebacks of failures")
    commands = parser.add_subparsers(dest="command", required=True)
    worker_parser(commands.add_parser("worker", help="serve a model from its request stream"))
    submit = commands.add_parser("submit", help="print the most likely next tokens of a text")
    submit.add_argument("text", nargs="?", help="the prompt; - reads it from standard input")
    submit.add_argument("--prompt-file", default=None, help="read the prompt from this file")
    submit.add_argument("--top-k", type=int, default=10)
    submit.add_argument("--model", default="smollm2-135m")
    submit.add_argument(
        "--redis-url",
        default=None,
        help="your tenant URL (default: $LMQ_REDIS_URL, else $REDIS_URL)",
    )
    submit.add_argument(
        "--cache-url",
        default=None,
        help="override the cache address the workers publish (rarely needed)",
    )
    submit.add_argument("--adapter", default=None, help="a LoRA adapter served for the model")
    demo.add_arguments(commands.add_parser("demo", help="run the whole pipeline locally"))
    status.add_arguments(
        commands.add_parser("status", help="backlog, workers and caches, read from Redis")
    )
    scheduler_arguments(commands.add_parser("scheduler", help="run experiments (arq worker)"))
    experiments_cli.add_arguments(
        commands.add_parser("experiment", help="submit, watch, cancel, collect experiments")
    )
    tenants.add_arguments(
        commands.add_parser("tenant", help="add, change, list or remove tenants (admin URL)")
    )
    adapters_cli.add_arguments(
        commands.add_parser("adapter", help="add, list or remove a model's LoRA adapters")
    )
    keda_triggers.add_arguments(
        commands.add_parser("keda-triggers", help="KEDA triggers for every tenant's streams")
    )
    # Its own flags are parsed by lmqueue.bench (see `main`); listed here for `lmq --help`.
    commands.add_parser("bench", help="run a benchmark: lmq bench --help", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `lmq` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = _VERBOSE in argv
    argv = [arg for arg in argv if arg != _VERBOSE]
    command = argv[0] if argv else ""
    try:
        if command == "worker":
            from lmqueue.workers.main import main as worker_main

            return worker_main(argv[1:], verbose=verbose)
        if command == "bench":
            from .bench import main as bench_main

            return bench_main(argv[1:])
        args = build_parser().parse_args(argv)
        if args.command == "submit":
            return _submit(args)
        if args.command == "status":
            from . import status

            return status.run(args)
        if args.command == "scheduler":
            from lmqueue.scheduler.main import run as run_scheduler

            return run_scheduler(args)
        if args.command == "experiment":
            from . import experiments_cli

            return experiments_cli.run(args)
        if args.command == "tenant":
            from . import tenants

            return tenants.run(args)
        if args.command == "adapter":
            from . import adapters_cli

            return adapters_cli.run(args)
        if args.command == "keda-triggers":
            from . import keda_triggers

            return keda_triggers.run(args)
        from . import demo

        return demo.run(args)
    except (Exception, KeyboardInterrupt) as exc:
        return report_failure(f"lmq {command}".strip(), exc, verbose)
