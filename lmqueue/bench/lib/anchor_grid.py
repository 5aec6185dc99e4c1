"""The in-process anchor at its best: a small grid of genlm-backend's own knobs, same run.

A ratio is only as good as its baseline. genlm-backend's ``AsyncTransformer`` batches the
calls it gets within ``timeout`` seconds, at most ``batch_size`` of them (defaults 20 and
0.02), while lmqueue's backend runs with 32 rows and 5 ms. So the benchmarks with this anchor
(``model``, ``programs``) run it on every point of the grid

    batch_size in {its default, the workload's particle count, lmqueue's 32}
    timeout    in {its default, lmqueue's 0.005}

and divide by the best point measured in the same run; every point is printed and written.
"""

from __future__ import annotations

import argparse
import inspect
import os
from dataclasses import dataclass
from typing import Any

from . import devices
from .stack import CpuMeter
from .workload import Workload, result_figures

__all__ = ["AnchorConfig", "add_grid_argument", "grid", "best", "run_genlm", "run_in_process"]

#: lmqueue's own backend settings (``workers.backend_loader`` with default settings).
LMQUEUE_BATCH_SIZE = 32
LMQUEUE_TIMEOUT_S = 0.005


@dataclass(frozen=True)
class AnchorConfig:
    """One point of the grid: the anchor's ``batch_size`` and ``timeout``."""

    batch_size: int
    timeout_s: float

    @property
    def label(self) -> str:
        """``genlm b20 t0.02``: how the point is named in lines and result keys."""
        return f"genlm b{self.batch_size} t{self.timeout_s:g}"

    def kwargs(self) -> dict[str, Any]:
        """The constructor arguments of ``genlm.backend.llm.AsyncTransformer``."""
        return {"batch_size": self.batch_size, "timeout": self.timeout_s}


def add_grid_argument(parser: argparse.ArgumentParser) -> None:
    """``--anchor-grid``: ``full`` (the grid above) or ``defaults`` (the anchor's defaults)."""
    parser.add_argument(
        "--anchor-grid", choices=["full", "defaults"], default="full",
        help="genlm AsyncTransformer settings tried; the ratio divides by the best",
    )  # fmt: skip


def _defaults() -> tuple[int, float]:
    """The anchor's own defaults, read from its signature (not copied: an upgrade may move them)."""
    from genlm.backend.llm import AsyncTransformer

    params = inspect.signature(AsyncTransformer.__init__).parameters
    return int(params["batch_size"].default), float(params["timeout"].default)


def grid(particles: int, which: str = "full") -> list[AnchorConfig]:
    """The points to run: the anchor's defaults first, then the others, each once."""
    batch_default, timeout_default = _defaults()
    if which == "defaults":
        return [AnchorConfig(batch_default, timeout_default)]
    points: list[AnchorConfig] = []
    for batch_size in (batch_default, particles, LMQUEUE_BATCH_SIZE):
        for timeout_s in (timeout_default, LMQUEUE_TIMEOUT_S):
            point = AnchorConfig(batch_size, timeout_s)
            if point not in points:
                points.append(point)
    return points


def best(per_s: dict[str, float], points: list[AnchorConfig]) -> AnchorConfig:
    """The point with the most calls per second among those measured."""
    measured = [point for point in points if point.label in per_s]
    return max(measured, key=lambda point: per_s[point.label])


async def run_genlm(
    model: Any, tokenizer: Any, workload: Workload, point: AnchorConfig
) -> dict[str, Any]:
    """The workload on genlm-backend's in-process `AsyncTransformer` at one grid point."""
    from genlm.backend.llm import AsyncTransformer as GenlmTransformer

    lm = GenlmTransformer(model, tokenizer, **point.kwargs())
    figures = await run_in_process(lm, workload)
    lm.clear_cache()
    return figures


async def run_in_process(lm: Any, workload: Workload) -> dict[str, Any]:
    """The workload on an in-process `lm` (its KV of the prompt cached first): its figures,
    with this process's CPU time and GPU memory peaks."""
    lm.cache_kv(workload.prompt)
    meter = CpuMeter({"process": [os.getpid()]})
    devices.reset_torch_peaks()
    meter.start()
    result = await workload.run(lm)
    cpu = meter.stop()
    return {**result_figures(result, cpu), "gpu": devices.torch_peaks()}
