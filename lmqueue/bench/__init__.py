"""Benchmarks: ``lmq bench <command>`` or ``python -m lmqueue.bench <command>``.

One module per command (`commands` lists them all, in one table, and runs them); ``soak`` is a
package of its own. `lib` is the harness they share: the stack they run on (private Redis
servers, worker processes), loads, meters, reports, workloads, probes, child processes and
plots. Methodology and results: BENCHMARKS.md.
"""

from .commands import COMMANDS, main

__all__ = ["COMMANDS", "main"]
