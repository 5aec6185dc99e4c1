"""Picks a benchmark by name and runs it: ``lmq bench <name> [flags]``, or ``all``.

Benchmarks are imported only when run: they need the ``bench`` extra (psutil, matplotlib,
genlm-backend) that the rest of lmqueue does without. The trie benchmark lives in its own
module, written separately; it is run through its ``main(argv)`` (or ``run()``) when present.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["BENCHMARKS", "ALL_ORDER", "main"]

#: Benchmark name -> module, each with ``main(argv) -> int``.
BENCHMARKS = {
    "transport": "lmqueue.bench.transport",
    "cache": "lmqueue.bench.cache",
    "scaling": "lmqueue.bench.scaling",
    "model": "lmqueue.bench.model",
    "forward": "lmqueue.bench.forward",
    "memory": "lmqueue.bench.memory",
    "trie": "lmqueue.bench.trie",
    "programs": "lmqueue.bench.programs",
    "cluster": "lmqueue.bench.cluster",
    "fairness": "lmqueue.bench.fairness",
    "affinity": "lmqueue.bench.affinity",
    "adapters": "lmqueue.bench.adapters",
    "engines": "lmqueue.bench.engines",
    "soak": "lmqueue.bench.soak.run",
}
#: The order of ``all``: the fast transport-level ones first, the model-bound ones last.
ALL_ORDER = [
    "transport", "cache", "scaling", "cluster", "fairness", "forward", "model", "memory", "trie",
    "programs", "affinity", "adapters", "engines",
]  # fmt: skip

_USAGE = f"""usage: lmq bench {{{",".join(BENCHMARKS)},all}} [flags]

  lmq bench <name> --help   the flags of one benchmark
  lmq bench all             every benchmark with its default flags, in turn
Results: printed (the ratio that matters last) and written to bench-results/<name>.json.
"""


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark named by ``argv[0]`` with the remaining flags; the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE, end="")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "all":
        return _run_all(rest)
    if name not in BENCHMARKS:
        print(f"lmq bench: unknown benchmark {name!r}\n{_USAGE}", file=sys.stderr, end="")
        return 2
    entry = _entry_point(name)
    if entry is None:
        print(
            f"lmq bench: the {name} benchmark is not available ({BENCHMARKS[name]} missing)",
            file=sys.stderr,
        )
        return 2
    return entry(rest)


def _run_all(rest: list[str]) -> int:
    """Every benchmark with default flags (``--out-dir`` passes through); first failure wins."""
    status = 0
    started = time.monotonic()
    for name in ALL_ORDER:
        entry = _entry_point(name)
        if entry is None:
            print(f"== lmq bench {name}: skipped ({BENCHMARKS[name]} is not there)")
            continue
        args = rest if name != "trie" else []  # trie keeps its own flags
        try:
            code = entry(args)
        except Exception as exc:  # one broken benchmark must not hide the others' results
            print(f"== lmq bench {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            code = 1
        status = status or code
    print(f"== lmq bench all: done in {time.monotonic() - started:.0f} s")
    return status


def _entry_point(name: str) -> Callable[[list[str]], int] | None:
    """The module's ``main(argv)``, or a wrapper of its ``run()``; None if it is absent."""
    module_name = BENCHMARKS[name]
    if importlib.util.find_spec(module_name) is None:
        return None
    module = importlib.import_module(module_name)
    main_fn: Any = getattr(module, "main", None)
    if callable(main_fn):
        return lambda argv: int(main_fn(argv) or 0)
    run_fn: Any = getattr(module, "run", None)
    if callable(run_fn):
        return lambda argv: (run_fn(), 0)[1]
    return None
