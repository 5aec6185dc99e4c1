"""The main job, `lmq demo`, as the README's quickstart runs it (small sizes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


def _demo(*flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmqueue", "demo", *flags],
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, **(env or {})},
    )


def _throughput(stdout: str) -> float:
    match = re.search(r"= ([0-9.]+) calls/s through the queue", stdout)
    assert match, stdout
    return float(match.group(1))


def test_the_demo_runs_on_its_own_private_redis_with_the_mock_backend():
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "LMQ_REDIS_URL")}
    done = subprocess.run(
        [sys.executable, "-m", "lmqueue", "demo", "--backend", "mock", "--steps", "4",
         "--particles", "4"],
        capture_output=True, text=True, timeout=280, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "started a private redis-server" in done.stdout
    assert "no token contains the letter 'e'" in done.stdout
    assert _throughput(done.stdout) > 0


@pytest.mark.slow
def test_the_demo_generates_with_smollm2_through_the_queue(redis_url):
    done = _demo("--steps", "6", "--particles", "4", "--redis-url", redis_url)
    assert done.returncode == 0, done.stderr
    samples = re.findall(r"\[log w\s+(-?[0-9.]+)\] (['\"])(.*)\2$", done.stdout, re.MULTILINE)
    assert samples, done.stdout
    for _, _, text in samples:
        assert "e" not in text.lower()
    assert _throughput(done.stdout) > 0
