"""A one-minute soak, every fault kind once: nothing lost, duplicated or wrong, nothing stuck.

``make test-scenarios`` runs it (marked `scenario`); CI then runs ``make soak`` for five
minutes, whose memory series are long enough to be judged flat. Here a minute is too short for
that (the warm-up third is 20 s), so the test checks what a minute can show: each of the four
faults struck and was repaired, every call and experiment row is accounted for and right, and
the streams drained.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lmqueue.bench.commands import build_parser
from lmqueue.bench.soak import run as soak

pytestmark = pytest.mark.scenario


def test_a_minute_of_faults_loses_duplicates_and_falsifies_nothing(tmp_path: Path) -> None:
    args = build_parser("soak").parse_args(
        ["soak", "--minutes", "1", "--fault-every-s", "13", "--out-dir", str(tmp_path)]
    )
    del args.command
    result = soak.run(args)
    figures, ratios = result["figures"], result["ratios"]
    kinds = {event["kind"] for key, event in figures.items() if key.startswith("fault_")}
    assert kinds == {"kill_worker", "restart_redis", "restart_client", "stop_worker"}
    assert (ratios["lost"], ratios["duplicated"], ratios["wrong"]) == (0, 0, 0), result["summary"]
    assert ratios["stuck_pending"] == 0
    calls = figures["calls"]
    assert calls["answered"] > 1000 and calls["in_flight"] == 0
    settled = calls["answered"] + sum(calls["errors"].values()) + calls["lost"] + calls["abandoned"]
    assert settled == calls["calls"]
    assert figures["verify_programs"]["checked"] > 10 and figures["verify_experiments"]["checked"]
    assert figures["experiments"]["complete"] == figures["experiments"]["submitted"] > 0
    assert (tmp_path / "soak.png").stat().st_size > 10_000
