"""Where a benchmark's models run, and the GPU memory each process holds there.

``--device`` (``model``, ``programs``, ``adapters``): ``auto`` is where a worker puts its model
by default (CUDA when present, else the CPU), so in-process sides and workers run on the same
device; an explicit device goes to both. On a GPU the processes' resident memory (RSS) says
little of what they hold: each side's GPU memory is reported beside it, as each process's peak
allocated and reserved bytes (torch's own counters, for processes that run the benchmark's
code) and the bytes the driver reports in use by a process (``nvidia-smi``, for worker
processes, context included).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from collections.abc import Iterable
from typing import Any

__all__ = [
    "add_device_argument",
    "gpu_text",
    "gpu_used_bytes",
    "load_options",
    "resolve",
    "torch_peaks",
    "reset_torch_peaks",
    "worker_args",
]


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """``--device``: auto (CUDA if present), cpu, cuda, cuda:N."""
    parser.add_argument(
        "--device", default="auto", help="where models run: auto (CUDA if present), cpu, cuda:N"
    )


def resolve(device: str) -> str:
    """`device`, with ``auto`` made concrete."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_options(device: str) -> dict[str, Any]:
    """``from_pretrained`` options that put an in-process model on `device`."""
    return {"device_map": resolve(device)}


def worker_args(device: str) -> list[str]:
    """A worker's flags for `device` (none for ``auto``: a worker chooses the same itself)."""
    return [] if device == "auto" else ["--device", device]


def reset_torch_peaks() -> None:
    """Start this process's peak GPU memory counters anew (nothing without CUDA)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def torch_peaks() -> dict[str, int] | None:
    """This process's peak GPU memory since the last reset: allocated and reserved bytes."""
    import sys

    torch = sys.modules.get("torch")  # a client process that never imported torch holds none
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return {
        "peak_allocated_bytes": int(torch.cuda.max_memory_allocated()),
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved()),
    }


def gpu_used_bytes(pids: Iterable[int]) -> int | None:
    """GPU memory the driver reports in use by `pids` together; None without ``nvidia-smi``."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    wanted, used = set(pids), 0
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and int(pid) in wanted:
            used += int(mib.strip() or 0) << 20
    return used


def gpu_text(peaks: dict[str, int] | None, used: int | None = None) -> str:
    """How a side's GPU memory is printed beside its RSS."""
    parts = []
    if peaks is not None:
        parts.append(
            f"GPU peak allocated {peaks['peak_allocated_bytes'] / 2**20:.0f} MiB, reserved "
            f"{peaks['peak_reserved_bytes'] / 2**20:.0f} MiB"
        )
    if used is not None:
        parts.append(f"GPU in use (driver) {used / 2**20:.0f} MiB")
    return "; ".join(parts) if parts else "no GPU"
