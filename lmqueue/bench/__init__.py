"""Benchmarks: ``lmq bench <name>`` or ``python -m lmqueue.bench <name>``.

Each benchmark is a module with ``main(argv)``; `lmqueue.bench.dispatch` picks one by name
(``all`` runs them in turn). Each prints its raw figures and, last, the ratio that matters, and
writes ``bench-results/<name>.json``. Methodology and results: BENCHMARKS.md.
"""

from .dispatch import BENCHMARKS, main

__all__ = ["BENCHMARKS", "main"]
