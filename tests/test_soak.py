"""The soak's judgement, without a soak: accounting of journals, flatness, recovery times.

`lmq bench soak` (tests/test_soak_scenario.py runs it for a minute) decides pass or fail from
three pure computations; each is checked here on hand-made inputs, in milliseconds. The
monitor's reading of the queue Redis is checked on the session's real server.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis

from lmqueue.bench.soak import recovery
from lmqueue.bench.soak.flatness import flatness, theil_sen_slope
from lmqueue.bench.soak.journal import JournalWriter, answered_times, read_events, tally
from lmqueue.bench.soak.monitor import Monitor
from lmqueue.shared.keys import KeySpace


def _journal(path: Path, *events: tuple[str, dict]) -> Path:
    writer = JournalWriter(path)
    for name, fields in events:
        writer.write(name, **fields)
    writer.close()
    return path


def _end(batch: int, ok: int, **fields) -> tuple[str, dict]:
    return "end", {"b": batch, "ok": ok, **fields}


def test_every_call_of_a_journal_gets_exactly_one_outcome(tmp_path):
    path = _journal(
        tmp_path / "a.jsonl",
        ("start", {"pid": 1}),
        ("begin", {"b": 1, "n": 8}),
        _end(1, 8, retries=2, rerr={"Unavailable": 2}, s=[{"p": [1]}]),
        ("begin", {"b": 2, "n": 8}),
        _end(2, 5, err={"UnknownAdapter": 2}, lost=1),
        ("stats", {"duplicate_replies": 3}),
        ("begin", {"b": 3, "n": 8}),  # killed mid-step: abandoned with its process
        ("start", {"pid": 2}),
        ("begin", {"b": 1, "n": 4}),  # the new process numbers its batches afresh
        _end(1, 4),
        ("begin", {"b": 2, "n": 4}),  # still running
    )
    running = tally([path], final=False)
    assert (running.calls, running.answered, running.lost, running.abandoned) == (32, 17, 1, 8)
    assert running.in_flight == 4 and running.accounted
    assert running.errors == {"UnknownAdapter": 2}
    assert (running.retried, running.retried_errors) == (2, {"Unavailable": 2})
    assert running.duplicate_replies_dropped == 3 and running.duplicated == 0
    assert running.samples == [{"p": [1]}] and running.processes == 2
    final = tally([path])
    assert (final.abandoned, final.in_flight) == (12, 0) and final.accounted


def test_a_batch_ended_twice_or_a_call_answered_twice_counts_as_duplicated(tmp_path):
    path = _journal(
        tmp_path / "b.jsonl",
        ("start", {"pid": 1}),
        ("begin", {"b": 1, "n": 4}),
        _end(1, 4),
        _end(1, 4),
        ("begin", {"b": 2, "n": 4}),
        _end(2, 4, extra=1),
    )
    assert tally([path]).duplicated == 5


def test_a_torn_last_line_is_skipped_and_answered_calls_are_timed(tmp_path):
    path = _journal(tmp_path / "c.jsonl", ("begin", {"b": 1, "n": 2}), _end(1, 2))
    with path.open("a") as f:
        f.write('{"ev": "end", "b": 2, "ok"')  # kill -9 mid-write
    assert [e["ev"] for e in read_events(path)] == ["begin", "end"]
    (when, count), *_ = answered_times([path])
    assert count == 2 and when == json.loads(path.read_text().splitlines()[1])["t"]


def test_theil_sen_ignores_a_restart_that_a_least_squares_line_follows():
    points = [(float(t), 300.0 + 0.01 * t) for t in range(0, 600, 5)]
    points[60:70] = [(t, 20.0) for t, _ in points[60:70]]  # a killed worker, started again
    assert theil_sen_slope(points) == pytest.approx(0.01, rel=0.05)


def test_a_slow_leak_is_rising_and_a_noisy_steady_series_is_flat():
    leak = [(float(t), 300.0 + 0.1 * t) for t in range(0, 3600, 5)]  # +6 MiB a minute
    verdict = flatness("rss_mib:w", leak, floor=16.0)
    assert not verdict.flat and verdict.rise == pytest.approx(240, rel=0.02)
    assert verdict.slope_per_h == pytest.approx(360, rel=0.02)
    steady = [(float(t), 300.0 + (7 if t % 10 else -7)) for t in range(0, 3600, 5)]
    assert flatness("rss_mib:w", steady, floor=16.0).flat
    warming = [(float(t), min(t, 1000.0)) for t in range(0, 3600, 5)]  # fills, then stays
    assert flatness("cache", warming, floor=0.0).flat


def test_a_process_restarted_at_another_level_is_judged_life_by_life():
    """A soak's client, killed at 180 s, came back 46 MiB higher and stayed there (CI,
    2026-11-29): over one life the step reads as a rise; a leak in each life still rises."""
    stepped = [(float(t), 173.0 if t < 185 else 219.0) for t in range(0, 300, 5)]
    assert not flatness("rss_mib:client", stepped, floor=16.0).flat
    verdict = flatness("rss_mib:client", stepped, floor=16.0, breaks=[185.0])
    assert verdict.flat and verdict.rise == 0.0 and verdict.lives == 2
    assert "(2 lives)" in verdict.line()
    leaking = [(float(t), 100.0 + 0.2 * (t if t < 185 else t - 185)) for t in range(0, 300, 5)]
    verdict = flatness("rss_mib:client", leaking, floor=16.0, breaks=[185.0])
    assert not verdict.flat and verdict.slope_per_h == pytest.approx(720)
    assert flatness("rss_mib:client", stepped, floor=16.0, breaks=[10.0]).lives == 1


def test_the_monitor_marks_a_roles_new_pid_as_a_restart_of_its_process_series(redis_url):
    pids = {"client-alice": os.getpid(), "redis-queue": os.getppid()}  # live processes
    servers = SimpleNamespace(url=redis_url)
    rig = SimpleNamespace(
        cluster=None, queue_server=servers, cache=servers, pids=lambda: dict(pids)
    )
    monitor = Monitor(rig)  # type: ignore[arg-type]
    monitor.sample()
    monitor.sample()
    assert not monitor.restarts
    pids["client-alice"] = os.getppid()  # killed and started again (as another live process)
    monitor.sample()
    (when,) = monitor.restarts["rss_mib:client-alice"]
    assert when == monitor.series["rss_mib:client-alice"][-1][0]
    assert set(monitor.restarts) == {"rss_mib:client-alice", "gpu_mib:client-alice"}


def test_the_allowed_rise_is_a_share_of_the_level_or_the_floor():
    points = [(float(t), 1000.0 + 0.02 * t) for t in range(0, 3000, 10)]  # +40 over 2000 s
    assert flatness("x", points, floor=10.0).allowed == pytest.approx(0.05 * 1030, rel=0.02)
    assert flatness("x", points, floor=10.0).flat
    assert not flatness("x", points, floor=10.0, rel=0.01).flat
    assert flatness("x", points, floor=100.0, rel=0.01).flat


def test_recovery_is_the_first_bucket_after_repair_back_at_the_level():
    start = 1000.0
    points = [(start + t + 0.5, 50) for t in range(0, 300)]  # 50 calls a second...
    points = [(t, 0 if 1100 <= t < 1120 else n) for t, n in points]  # ...none for 20 s
    series = recovery.rates(points, start, start + 300)
    faults = [
        {"kind": "stop_worker", "at": start + 100, "repair_s": 10.0},
        {"kind": "kill_worker", "at": start + 200, "repair_s": 2.0},
    ]
    first, second = recovery.recoveries(series, faults, start)
    assert (first["level"], first["recovered_s"]) == (50.0, 25.0)
    assert second["recovered_s"] == 5.0
    kinds = recovery.by_kind([first, second])
    assert kinds["stop_worker"] == {
        "faults": 1, "recovered": 1, "worst_s": 25.0, "median_s": 25.0, "worst_repair_s": 10.0
    }  # fmt: skip


def test_a_rate_that_never_comes_back_before_the_next_fault_has_no_recovery():
    start = 0.0
    points = [(t + 0.5, 50 if t < 100 else 1) for t in range(0, 300)]
    series = recovery.rates(points, start, 300.0)
    faults = [{"kind": "restart_redis", "at": 100.0, "repair_s": 1.0},
              {"kind": "kill_worker", "at": 200.0, "repair_s": 1.0}]  # fmt: skip
    assert recovery.recoveries(series, faults, start)[0]["recovered_s"] is None
    assert recovery.by_kind(recovery.recoveries(series, faults, start))["restart_redis"] == {
        "faults": 1, "recovered": 0, "worst_s": None, "median_s": None, "worst_repair_s": 1.0
    }  # fmt: skip


def test_the_monitor_counts_experiment_keys_that_never_expire_not_those_kept_a_while(redis_url):
    """Finished experiments' keys and arq's results expire (their count follows the experiment
    rate); a key that never expires is what a leak leaves, and only those are counted in
    ``experiment_keys`` and ``scheduler_keys``; ``queue_keys`` counts every key."""
    keys = KeySpace(tenant="carol")
    admin = redis.Redis.from_url(redis_url)
    for n in range(5):  # finished: kept for a minute
        admin.hset(keys.experiment_record(f"done-{n}"), "status", "complete")
        admin.pexpire(keys.experiment_record(f"done-{n}"), 60_000)
    admin.hset(keys.experiment_record("running"), "status", "running")
    admin.zadd(keys.experiment_index(), {"running": 1})
    admin.xadd(keys.replies("c1"), {"r": b"x"})
    admin.set("arq:result:done-0", b"r", px=60_000)
    admin.zadd(keys.scheduler_queue(), {"j": 1})
    rig = SimpleNamespace(cluster=None, queue_server=SimpleNamespace(url=redis_url),
                          cache=SimpleNamespace(url=redis_url), pids=dict)  # fmt: skip
    monitor = Monitor(rig)  # type: ignore[arg-type]
    monitor.sample()
    latest = {name: points[-1][1] for name, points in monitor.series.items()}
    assert latest["experiment_keys"] == 2  # the running record and the index
    assert latest["scheduler_keys"] == 1  # the queue; the result expires
    assert latest["queue_keys"] == 10
    assert (latest["reply_streams"], latest["reply_entries"]) == (1, 1)
    admin.persist(keys.experiment_record("done-0"))  # an expiry lost: it stays for good
    monitor.sample()
    assert monitor.series["experiment_keys"][-1][1] == 3
    admin.close()


def test_the_rig_names_a_worker_or_scheduler_that_ended_with_its_code_and_last_log_lines(
    tmp_path,
):
    import sys

    from lmqueue.bench.soak.rig import Rig, RigConfig
    from lmqueue.devstack import ChildProcess

    rig = Rig(RigConfig(work=tmp_path))
    died = ChildProcess("soak-w0", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"],
                        tmp_path / "w0.log")  # fmt: skip
    lives = ChildProcess("soak-w1", [sys.executable, "-c", "import time; time.sleep(60)"],
                         tmp_path / "w1.log")  # fmt: skip
    rig.workers = [died.start(), lives.start()]
    try:
        died.process.wait(30)
        exited = rig.exited()
        assert list(exited) == ["soak-w0"]
        assert exited["soak-w0"]["exit_code"] == 3
        assert exited["soak-w0"]["log_tail"][-1] == "boom"
        assert "soak-w0" not in rig.pids() and "soak-w1" in rig.pids()
    finally:
        lives.kill()
