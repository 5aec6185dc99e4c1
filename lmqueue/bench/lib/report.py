"""`Report`: what every benchmark prints and writes, in one shape.

A benchmark prints its raw figures as they come, then, last, the one line with the ratio that
matters, so two runs can be compared by their last lines. The same figures, the configuration
and the machine they ran on go to ``bench-results/<name>.json``: numbers from a loaded 2-core
machine and a quiet 32-core one are not comparable, and the file says which is which.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["Report", "machine_info", "save_figure", "DEFAULT_OUT_DIR"]

DEFAULT_OUT_DIR = Path("bench-results")


def save_figure(fig: Any, path: Path) -> Path:
    """Write a matplotlib figure to `path` (its folder made) and release it."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def machine_info() -> dict[str, Any]:
    """The details BENCHMARKS.md asks for: cores, CPU model, memory, versions, load."""
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": _lscpu_model(),
        "memory_gib": round(_mem_total_bytes() / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": _version("torch"),
        "numpy": _version("numpy"),
        "redis_py": _version("redis"),
        "hiredis": _version("hiredis"),
        "redis_server": _redis_server_version(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


class Report:
    """Collects one benchmark's figures; `finish` prints the ratio line and writes the JSON."""

    def __init__(self, name: str, config: dict[str, Any]) -> None:
        self.name = name
        self.config = config
        self.figures: dict[str, Any] = {}
        self.machine = machine_info()
        self._started = time.monotonic()
        print(f"== lmq bench {name}  (load average {_load_text(self.machine['load_avg'])})")

    def figure(self, key: str, value: Any, line: str | None = None) -> None:
        """Record a raw figure under `key` and print it (as `line` if given)."""
        self.figures[key] = value
        print(f"  {line if line is not None else f'{key}: {value}'}", flush=True)

    def finish(
        self, ratios: Mapping[str, float | None], summary: str, out_dir: Path
    ) -> dict[str, Any]:
        """Print `summary` (the ratio that matters) last and write the result file."""
        load_end = [round(x, 2) for x in os.getloadavg()]
        result = {
            "benchmark": self.name,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "elapsed_s": round(time.monotonic() - self._started, 1),
            "machine": self.machine,
            "load_avg_end": load_end,
            "config": self.config,
            "figures": self.figures,
            "ratios": ratios,
            "summary": summary,
        }
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{self.name}.json"
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"  (load average at the end {_load_text(load_end)}; wrote {path})")
        print(summary, flush=True)
        return result


def _load_text(load: list[float]) -> str:
    return " ".join(f"{x:.2f}" for x in load)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor() or "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _mem_total_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _redis_server_version() -> str | None:
    try:
        out = subprocess.run(
            ["redis-server", "--version"], capture_output=True, text=True, timeout=5
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for part in out.split():
        if part.startswith("v="):
            return part[2:]
    return out.strip() or None
