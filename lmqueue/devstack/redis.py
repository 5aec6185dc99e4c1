"""`LocalRedis`: a private redis-server on a free loopback port (demo, benchmarks, tests)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from lmqueue.shared.redis_roles import CACHE_POLICY  # the benchmarks' caches run it

from .stop import kill_process, stop_process

__all__ = ["CACHE_POLICY", "LocalRedis", "free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalRedis:
    """A redis-server child process without persistence, listening on 127.0.0.1 only.

    `restart` starts a fresh, empty server on the same port, as a Redis restart without
    persistence does in production. Use as a context manager or call `start`/`stop`.

    Args:
        port: the port to listen on; a free one by default.
        maxmemory: e.g. ``"256mb"``; 0 leaves memory unbounded.
        policy: the eviction policy (``noeviction`` for the queue role).
        args: further ``redis-server`` options, e.g. ``["--aclfile", path]``.
    """

    def __init__(
        self,
        port: int | None = None,
        maxmemory: str = "0",
        policy: str = "noeviction",
        args: Sequence[str] = (),
    ):
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.policy = policy
        self.args = list(args)
        self._dir = Path(tempfile.mkdtemp(prefix="lmq-redis-"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The redis:// URL of database 0."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0, ready: Callable[[], bool] | None = None) -> LocalRedis:
        """Start the server and wait until it answers PING (or until `ready()` is true)."""
        args = [
            self.binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self._dir),
            "--maxmemory",
            self.maxmemory,
            "--maxmemory-policy",
            self.policy,
            "--logfile",
            str(self._dir / "redis.log"),
            *self.args,
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.process.returncode}: {err}")
            if (ready or self._answers_ping)():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} in {timeout_s} s")

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s)."""
        stop_process(self.process, grace_s=5)
        if self.process is not None and self.process.stderr:
            self.process.stderr.close()
        self.process = None

    def kill(self) -> None:
        """SIGKILL the server, as a crash would."""
        kill_process(self.process)

    def restart(self) -> None:
        """Stop and start again on the same port: an empty server, like a restart."""
        self.kill()
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
