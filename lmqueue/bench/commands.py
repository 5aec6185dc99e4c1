"""``lmq bench <command> [flags]`` (or ``python -m lmqueue.bench``): the one list of benchmarks.

Each command is a module of `lmqueue.bench` with ``add_arguments(parser)`` and ``run(args)``:
it prints its raw figures and, last, the ratio that matters, writes
``<out-dir>/<command>.json`` and returns that result. Its module is imported only when the
command runs (its ``--help`` too): benchmarks need the ``bench`` extra (psutil, matplotlib,
genlm-backend) that the rest of lmqueue does without. What they share is `lmqueue.bench.lib`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

from lmqueue.shared.failures import INTERRUPTED_EXIT, USAGE_EXIT, ArgumentParser

from .lib.report import DEFAULT_OUT_DIR

__all__ = ["COMMANDS", "Command", "build_parser", "main"]


class Command(NamedTuple):
    """A command's module and its line in ``lmq bench --help``; `in_all`: run by ``all``."""

    module: str
    summary: str
    in_all: bool = True


#: Every ``lmq bench`` command, in the order ``all`` runs them: the fast transport-level ones
#: first, the model-bound ones last.
COMMANDS = {
    "transport": Command("transport", "full-vocabulary replies/s, lmqueue against the raw probe"),
    "cache": Command("cache", "latency of a call answered from the shared cache"),
    "scaling": Command("scaling", "the queue's overhead with 1..8 workers, and real work"),
    "cluster": Command("cluster", "one Redis against a 3-master Redis Cluster"),
    "fairness": Command("fairness", "tenants sharing one worker, against FIFO on one stream"),
    "forward": Command("forward", "what one hf forward costs beyond the model's arithmetic"),
    "model": Command("model", "an SMC workload, lmqueue against genlm-backend in-process"),
    "memory": Command("memory", "worker and Redis memory stay under their bounds"),
    "trie": Command("trie", "trie masses of a batch of distributions, against genlm-backend"),
    "programs": Command("programs", "K programs sharing one worker, or each loading its model"),
    "affinity": Command("affinity", "do a program's calls meet their KV on two workers?"),
    "adapters": Command("adapters", "LoRA adapters on one worker, or merged models on four"),
    "engines": Command("engines", "a vLLM worker against an hf one, plain vLLM, genlm-backend"),
    "soak": Command("soak.run", "tenants' programs for minutes under faults", in_all=False),
}

_ALL = "every command but soak, in turn, with default flags (--out-dir passes through)"
_EPILOG = """\
lmq bench COMMAND --help shows a command's flags. Results: printed (the ratio that matters
last) and written to bench-results/<command>.json; methodology and figures: BENCHMARKS.md."""


def _listing() -> str:
    """The commands and their summaries, one a line (argparse's own list misaligns them)."""
    lines = [(name, entry.summary) for name, entry in COMMANDS.items()] + [("all", _ALL)]
    width = max(len(name) for name, _ in lines)
    return "\n".join(f"  {name:<{width}}  {summary}" for name, summary in lines)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``lmq bench`` parser, with the flags of `command` (importing its module alone)."""
    parser = ArgumentParser(
        prog="lmq bench",
        description=f"Run a benchmark.\n\ncommands:\n{_listing()}",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help="one of the commands above"
    )
    for name in COMMANDS:
        sub = subparsers.add_parser(name)
        if name == command:
            module = _module(name)
            sub.description = module.__doc__
            sub.formatter_class = argparse.RawDescriptionHelpFormatter
            module.add_arguments(sub)
    run_all = subparsers.add_parser("all", description=_ALL)
    run_all.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command that `argv` names with its flags; the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv else None
    if command is not None and command not in (*COMMANDS, "all") and not command.startswith("-"):
        build_parser().print_usage(sys.stderr)
        print(f"lmq bench: unknown benchmark {command!r}", file=sys.stderr)
        return USAGE_EXIT
    args = build_parser(command).parse_args(argv)
    name = vars(args).pop("command")
    try:
        return _run_all(args.out_dir) if name == "all" else _exit_code(_module(name).run(args))
    except KeyboardInterrupt:
        print(f"lmq bench {name}: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT


def _run_all(out_dir: Path) -> int:
    """Every command with ``in_all``, default flags but `out_dir`; the first failure's code."""
    status = 0
    started = time.monotonic()
    for name, entry in COMMANDS.items():
        if not entry.in_all:
            continue
        args = build_parser(name).parse_args([name, "--out-dir", str(out_dir)])
        del args.command
        try:
            code = _exit_code(_module(name).run(args))
        except Exception as exc:  # one broken benchmark must not hide the others' results
            print(f"== lmq bench {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            code = 1
        status = status or code
    print(f"== lmq bench all: done in {time.monotonic() - started:.0f} s")
    return status


def _module(name: str) -> Any:
    return importlib.import_module(f"{__package__}.{COMMANDS[name].module}")


def _exit_code(result: dict[str, Any]) -> int:
    """1 when the result says a target was missed (``passed`` false, as the soak's), else 0."""
    return 1 if result.get("passed") is False else 0
