"""Every `lmq` command reports a failure as one line with what to do, and a non-zero exit."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest


def _lmq(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LMQ_") and k != "REDIS_URL"}
    return subprocess.run(
        [sys.executable, "-m", "lmqueue", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **(env or {})},
    )


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{sock.getsockname()[1]}/0"


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_submit_to_an_unreachable_redis_says_so_in_one_line():
    done = _lmq("submit", "hello", "--redis-url", _closed_port_url(),
                env={"LMQ_CONNECT_TIMEOUT_S": "0.3"})  # fmt: skip
    assert done.returncode == 1
    line = _one_line(done)
    assert line.startswith("lmq submit: Unavailable: ")
    assert "LMQ_REDIS_URL" in line  # what to do


def test_verbose_adds_the_traceback():
    done = _lmq("--verbose", "submit", "hello", "--redis-url", _closed_port_url(),
                env={"LMQ_CONNECT_TIMEOUT_S": "0.3"})  # fmt: skip
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("lmq submit: Unavailable: ")


def test_submit_for_a_model_nobody_serves_names_the_model_and_the_remedy(redis_url):
    done = _lmq("submit", "hello", "--model", "nobody-serves-this", "--redis-url", redis_url,
                env={"LMQ_CONNECT_TIMEOUT_S": "0.2"})  # fmt: skip
    assert done.returncode == 2
    line = _one_line(done)
    assert line.startswith("lmq submit: UnknownModel: ") and "nobody-serves-this" in line
    assert "lmq worker --model" in line


def test_a_bad_setting_is_named_with_its_value_and_exits_2():
    done = _lmq("submit", "hello", env={"LMQ_TIMEOUT_S": "soon"})
    assert done.returncode == 2
    line = _one_line(done)
    assert line.startswith("lmq submit: SettingsError: LMQ_TIMEOUT_S='soon'")


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--backend", "mock", "--device", "cuda:0"], "the mock backend cannot be placed"),
        (["--backend", "mock", "--backend-opts", '{"warp_speed": 9}'], "warp_speed"),
        (["--backend", "mock", "--backend-opts", "[1]"], "expected a JSON object"),
        (["--backend", "mock", "--model", "bad name"], "invalid model name"),
    ],
)
def test_the_worker_refuses_options_it_cannot_honour_before_loading(flags, says):
    args = ["worker", "--model", "smollm2-135m", "--redis-url", _closed_port_url(), *flags]
    done = _lmq(*args)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr  # a worker logs as it starts; the failure is one line
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("lmq worker: SettingsError: ") and says in line
