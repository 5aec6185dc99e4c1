"""`JsonChild`: a benchmark's child process, driven by a JSON line each way (no pickle).

Whatever it needs that ``ps`` must not show (a URL with a password) goes over stdin, never on
its command line. Ending its input tells it to close down; it is killed if it has not
exited 30 s later.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

__all__ = ["JsonChild"]


class JsonChild:
    """A child process run by `argv`; `send` a line, read the `answer` to it."""

    def __init__(self, argv: Sequence[str], line_limit: int = 1 << 16) -> None:
        self.argv = list(argv)
        self.line_limit = line_limit
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int:
        """The child's pid."""
        assert self._proc is not None, "not started"
        return self._proc.pid

    async def start(self) -> None:
        """Start the child."""
        self._proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            limit=self.line_limit,
        )  # fmt: skip

    async def close(self) -> None:
        """End its input and wait for it to exit (killed after 30 s)."""
        proc = self._proc
        if proc is None:
            return
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()

    async def send(self, line: str) -> None:
        """Write one line to its stdin."""
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(line.encode() + b"\n")
        await self._proc.stdin.drain()

    async def answer(self, key: str) -> Any:
        """Read its next line, a JSON object, and return its `key`."""
        assert self._proc is not None and self._proc.stdout is not None
        line = await self._proc.stdout.readline()
        if not line:
            code = await self._proc.wait()
            raise RuntimeError(f"{self.argv[-1]} exited ({code}) before answering {key!r}")
        return json.loads(line)[key]
