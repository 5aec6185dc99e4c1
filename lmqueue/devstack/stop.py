"""How every local child process ends: `stop_process` (a clean exit, then force) or
`kill_process` (a crash)."""

from __future__ import annotations

import signal
import subprocess
from typing import Any

__all__ = ["stop_process", "kill_process"]


def stop_process(process: subprocess.Popen[Any] | None, grace_s: float) -> int | None:
    """SIGTERM `process`, wait up to `grace_s` for it to exit, then SIGKILL it; its exit code.

    A stopped process (SIGSTOP, a fault test) is continued first: it could not act on SIGTERM.
    None if it never started; an exited one is only reaped.
    """
    if process is None:
        return None
    if process.poll() is None:
        process.send_signal(signal.SIGCONT)
        process.terminate()
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            return kill_process(process)
    return process.returncode


def kill_process(process: subprocess.Popen[Any] | None) -> int | None:
    """SIGKILL `process`, as a crash would, and reap it; its exit code (None if never started)."""
    if process is None:
        return None
    if process.poll() is None:
        process.kill()
    return process.wait()
