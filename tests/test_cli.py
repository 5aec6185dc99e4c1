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


def test_submit_labels_its_columns_and_reads_the_prompt_from_stdin_or_a_file(redis_url, tmp_path):
    from lmqueue.devstack import WorkerProcess

    worker = WorkerProcess("smollm2-135m", "mock", redis_url, "submit-0", log_dir=tmp_path)
    worker.start()
    try:
        prompt = tmp_path / "prompt.txt"
        prompt.write_text("The cat sat on the")
        by_file = _lmq("submit", "--prompt-file", str(prompt), "--top-k", "3",
                       "--redis-url", redis_url, env={"LMQ_CONNECT_TIMEOUT_S": "60"})  # fmt: skip
        by_stdin = subprocess.run(
            [sys.executable, "-m", "lmqueue", "submit", "-", "--top-k", "3", "--redis-url",
             redis_url], input="The cat sat on the", capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        assert worker.stop() == 0, worker.log()
    assert by_file.returncode == 0, by_file.stderr
    header, *rows = by_file.stdout.splitlines()
    assert header.split() == ["token", "logprob", "prob", "text"] and len(rows) == 3
    token, logprob, prob = rows[0].split()[:3]
    assert float(logprob) <= 0 and abs(2.718281828459045 ** float(logprob) - float(prob)) < 1e-3
    assert by_stdin.returncode == 0 and by_stdin.stdout == by_file.stdout


def test_a_missing_prompt_file_is_named_and_exits_2(tmp_path):
    done = _lmq("submit", "--prompt-file", str(tmp_path / "nope.txt"))
    assert done.returncode == 2
    assert (
        _one_line(done)
        == f"lmq submit: cannot read {tmp_path / 'nope.txt'}: No such file or directory"
    )


def test_no_password_reaches_a_usage_error_or_a_failure_line():
    secret = "hunter2-secret"
    url = _closed_port_url().replace("redis://", f"redis://admin:{secret}@")
    for args in (
        ["submit", "hi", url],  # argparse usage error: unrecognized arguments
        ["tenant", "add", "acme", url],  # the same, from a subcommand's parser
        ["tenant", "add", "acme", "--redis-url", url],  # unreachable: a failure line
        ["submit", "hi", "--redis-url", url.replace("redis://", "http://")],  # bad setting
        ["status", "--redis-url", url],
        ["--verbose", "status", "--redis-url", url],  # tracebacks too
        ["worker", "--model", "m", "--backend", "mock", "--redis-url", "x", url],
        ["scheduler", "--redis-url", "x", url],
    ):
        done = _lmq(*args)
        assert done.returncode in (1, 2), (args, done.stderr)
        assert secret not in done.stderr + done.stdout, args
        assert "admin:***@" in done.stderr, (args, done.stderr)


def test_the_default_url_is_said_not_used_silently():
    done = _lmq("status", env={"LMQ_CONNECT_TIMEOUT_S": "1"})
    assert "no --redis-url, LMQ_REDIS_URL or REDIS_URL given: using redis://127.0.0.1:6379/0" in (
        done.stderr + done.stdout
    )


def test_a_wrong_password_is_refused_at_once_with_exit_2_and_the_url_masked():
    import time

    import redis

    from lmqueue.devstack import LocalRedis

    with LocalRedis() as server:
        redis.Redis.from_url(server.url).config_set("requirepass", "the-right-one")
        wrong = server.url.replace("redis://", "redis://default:the-wrong-one@")
        for args in (["submit", "hi"], ["status"], ["tenant", "list"],
                     ["experiment", "list"], ["scheduler"]):  # fmt: skip
            started = time.monotonic()
            done = _lmq(*args, "--redis-url", wrong, env={"LMQ_CONNECT_TIMEOUT_S": "30"})
            took_s = time.monotonic() - started
            # the scheduler logs as it starts; the failure is its last line
            line = (
                done.stderr.strip().splitlines()[-1] if args == ["scheduler"] else _one_line(done)
            )
            assert done.returncode == 2, (args, done.stderr)
            assert "AuthenticationFailed" in line and "wrong user or password" in line, line
            assert "the-wrong-one" not in line and "default:***@" in line, line
            assert took_s < 20, (args, took_s)  # no retrying until the 30 s connect timeout
