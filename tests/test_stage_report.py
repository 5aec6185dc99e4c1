"""Stage marks (`shared.stage_trace`) and reading one tenant's round trip back from them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lmqueue.bench.lib.stage_report import idle_gaps, read_marks, report_lines, round_trips
from lmqueue.shared import stage_trace


@pytest.fixture
def tracing(tmp_path: Path) -> Iterator[Path]:
    path = stage_trace.start(tmp_path, "test")
    yield path
    stage_trace.stop()


def test_marks_are_written_with_their_details_only_while_started(tracing: Path) -> None:
    assert stage_trace.enabled()
    stage_trace.mark("pick", "a:16,b:16")
    stage_trace.mark("forward_end")
    stage_trace.stop()
    stage_trace.mark("after_stop")
    assert not stage_trace.enabled()
    marks = read_marks(tracing)
    assert [(stage, details) for _, stage, details in marks] == [
        ("pick", "a:16,b:16"), ("forward_end", ""),
    ]  # fmt: skip
    assert marks[0][0] <= marks[1][0]


def _ms(seconds: float) -> float:
    return seconds / 1000


def test_a_round_trip_is_measured_from_the_end_of_each_forward_holding_the_tenants_calls() -> None:
    worker = [
        (_ms(0), "pick", "a:16,b:16"), (_ms(1), "forward_start", ""),
        (_ms(100), "forward_end", ""),
        (_ms(100.5), "write_start", "a"),  # another tenant's write: not B's
        (_ms(101), "write_start", "b"), (_ms(101.2), "writer_start", "16"),
        (_ms(101.5), "writer_cmds", ""), (_ms(102), "writer_sent", ""),
        (_ms(103), "writer_done", ""), (_ms(103.5), "written", "b"),
        (_ms(105), "read", "b:8"),  # half of B's calls back: not yet
        (_ms(106), "read", "a:40,b:16"), (_ms(106.5), "pick", "a:16,b:16"),
        (_ms(107), "forward_start", ""), (_ms(200), "forward_end", ""),
        (_ms(201), "pick", "a:32"), (_ms(203), "forward_start", ""),  # B not in this one
        (_ms(300), "forward_end", ""), (_ms(301), "forward_start", ""),
    ]  # fmt: skip
    client = [(_ms(104), "replies", "16"), (_ms(104.2), "settled", ""),
              (_ms(104.5), "submit", "16"), (_ms(104.9), "submitted", "")]  # fmt: skip
    stages = round_trips(worker, client, "b", 0.0, _ms(250))
    expected = {"write_start": 1.0, "writer_start": 1.2, "writer_cmds": 1.5, "writer_sent": 2.0,
                "writer_done": 3.0, "written": 3.5,
                "client.replies": 4.0, "client.settled": 4.2, "client.submit": 4.5,
                "client.submitted": 4.9, "read": 6.0, "pick": 6.5,
                "forward_start": 7.0}  # fmt: skip
    # the second forward held B's calls too, but nothing of B's came after it
    assert {stage: values[0] for stage, values in stages.items()} == pytest.approx(expected)
    assert stages["forward_start"] == pytest.approx([7.0, 3.0])
    assert stages["written"] == pytest.approx([3.5])
    assert round_trips(worker, client, "b", _ms(250), _ms(400)) == {s: [] for s in stages}
    assert idle_gaps(worker, 0.0, _ms(400)) == pytest.approx([7.0, 3.0, 1.0])
    lines = report_lines(stages, idle_gaps(worker, 0.0, _ms(400)), "B")
    assert lines[0].startswith("B's round trip") and "forward_start" in lines[-2]
