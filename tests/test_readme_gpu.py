"""The README's "after" program (a genlm-control program moved to `QueueLM`) runs as printed,
against a worker serving SmolLM2-135M on the CPU (the README names a 1.7B model: `MODEL` is the
program's own switch for another one)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from workers_in_threads import ThreadedWorker

pytest.importorskip("genlm.control")

README = Path(__file__).resolve().parent.parent / "README.md"


def _after_program() -> str:
    section = README.read_text().split("### Before and after: a genlm-control program")[1]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    (after,) = [block for block in blocks if "as_genlm" in block]
    return after


@pytest.mark.slow
# genlm-control's note that the regex leaves a small part of the vocabulary: the point of it
@pytest.mark.filterwarnings("ignore:Common vocabulary:RuntimeWarning")
def test_the_readmes_genlm_control_program_runs_on_the_queue(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lmqueue.workers.backends.hf import AsyncTransformer

    backend = AsyncTransformer.from_name("smollm2-135m")
    served = ThreadedWorker(backend, redis_url, model="smollm2-135m").start()
    monkeypatch.setitem(os.environ, "LMQ_REDIS_URL", redis_url)
    monkeypatch.setitem(os.environ, "MODEL", "smollm2-135m")
    try:
        exec(compile(_after_program(), str(README), "exec"), {"__name__": "__main__"})
    finally:
        served.stop()
    printed = capsys.readouterr().out
    # a posterior over the regex's completions: each a direction, the weights summing to 1
    found = dict(re.findall(r"'( (?:north|south|east|west))': ([0-9.e-]+)", printed))
    assert found and sum(float(w) for w in found.values()) == pytest.approx(1.0)
