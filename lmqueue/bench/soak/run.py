"""``lmq bench soak --minutes N [--cluster]``: a deployment's day, compressed, under faults.

Three tenants share two hf workers (`rig`): two run SMC programs in client processes of
their own, one runs ``score`` experiments through the arq scheduler. Every ``--fault-every-s``
seconds the next fault of the rotation strikes (`faults`: kill -9 of a worker, a restart of
the queue Redis from its AOF, kill -9 of a client process mid-program, SIGSTOP of a worker
past its claim timeout; on ``--cluster``, kill -9 of a master instead of the Redis restart).
Meanwhile `monitor` samples memory every ``--sample-s`` seconds.

At the end the clients finish their programs, the request streams must drain, and:

* every call is accounted for (`journal`): answered, typed error, lost or abandoned with its
  killed process; sampled rows and every experiment row are checked against the model run
  in this process (`verify`). Target: lost 0, duplicated 0, wrong 0, no stuck stream;
* every memory series is flat after the warm-up third (`flatness`);
* throughput comes back after each fault (`recovery`), reported per fault kind.

Results go to ``<out-dir>/soak.json`` (``soak-cluster.json``), the plot beside it as PNG. The
exit status is 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any

from ..lib.report import DEFAULT_OUT_DIR, Report
from . import recovery
from .experiments import ExperimentLoop
from .faults import FaultSchedule
from .flatness import flatness
from .journal import answered_times, tally
from .monitor import Monitor, floor_of
from .plot import plot
from .rig import ADAPTERS, EXPERIMENT_TENANT, Rig, RigConfig
from .verify import verify

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The soak's flags."""
    parser.add_argument("--minutes", type=float, default=5.0, help="length of the run")
    parser.add_argument("--cluster", action="store_true", help="queue on a 3-master cluster")
    parser.add_argument("--fault-every-s", type=float, default=60.0)
    parser.add_argument("--sample-s", type=float, default=5.0, help="memory sampling period")
    parser.add_argument("--claim-idle-ms", type=int, default=5000, help="workers' claim timeout")
    parser.add_argument("--particles", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--work-dir", type=Path, default=None, help="default: <out-dir>/soak-work")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the soak; returns the result written to ``<out-dir>/soak.json``."""
    name = "soak-cluster" if args.cluster else "soak"
    report = Report(name, {k: str(v) for k, v in vars(args).items()})
    work = (args.work_dir or args.out_dir / f"{name}-work").resolve()  # redis-server chdirs
    for stale in work.glob("journal-*.jsonl"):  # the model and adapters may be reused
        stale.unlink()
    shutil.rmtree(work / "logs", ignore_errors=True)
    config = RigConfig(work=work, cluster=args.cluster, claim_idle_ms=args.claim_idle_ms,
                       particles=args.particles, steps=args.steps)  # fmt: skip
    rig = Rig(config)
    try:
        rig.start()
        report.figure("started", rig.pids(), line=f"rig up: {', '.join(rig.pids())}")
        monitor = Monitor(rig)
        loop = ExperimentLoop(rig.urls[EXPERIMENT_TENANT], rig.model)
        faults = asyncio.run(_drive(rig, args, monitor, loop, report))
        drained = _drain(monitor)
        exited = rig.exited()
    finally:
        rig.close()
    return _judge(report, rig, monitor, loop, faults, drained, exited, args)


async def _drive(
    rig: Rig, args: argparse.Namespace, monitor: Monitor, loop: ExperimentLoop, report: Report
) -> list[dict[str, Any]]:
    """Sample, run experiments and inflict faults until the time is up; the faults' events."""
    stopping = asyncio.Event()
    experiments = asyncio.create_task(loop.run(stopping))
    sampling = asyncio.create_task(_sample_until(monitor, args.sample_s, stopping))
    schedule = FaultSchedule(rig)
    events: list[dict[str, Any]] = []
    end = time.monotonic() + args.minutes * 60
    next_fault = time.monotonic() + args.fault_every_s
    while time.monotonic() < end:
        await asyncio.sleep(max(0.0, min(next_fault, end) - time.monotonic()))
        if time.monotonic() >= end:
            break
        event = (await asyncio.to_thread(schedule.next_fault)).as_dict()
        events.append(event)
        so_far = tally([c.journal for c in rig.clients], final=False)
        report.figure(f"fault_{len(events)}", event, line=(
            f"{(event['at'] - monitor.started) / 60:5.1f} min {event['kind']:<14} "
            f"{event['target']:<22} repaired in {event['repair_s']:5.1f} s; calls so far "
            f"{so_far.calls}, answered {so_far.answered}, lost {so_far.lost}"))  # fmt: skip
        next_fault += args.fault_every_s
    stopping.set()
    await asyncio.to_thread(rig.stop_clients)
    await asyncio.wait_for(experiments, 600)
    await sampling
    return events


async def _sample_until(monitor: Monitor, every_s: float, stopping: asyncio.Event) -> None:
    while not stopping.is_set():
        await asyncio.to_thread(monitor.sample)
        try:
            await asyncio.wait_for(stopping.wait(), every_s)
        except TimeoutError:
            pass


def _drain(monitor: Monitor, timeout_s: float = 60.0) -> dict[str, float]:
    """Wait until no request waits or is pending; what was left."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = monitor._queue()
        stuck = {k: left.get(k, 0.0) for k in ("request_entries", "pending_entries")}
        if not any(stuck.values()) or time.monotonic() > deadline:
            return {**stuck, "dead_letters": left.get("dead_letters", 0.0)}
        time.sleep(0.5)


def _judge(
    report: Report,
    rig: Rig,
    monitor: Monitor,
    loop: ExperimentLoop,
    faults: list[dict[str, Any]],
    drained: dict[str, float],
    exited: dict[str, dict[str, Any]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    journals = [c.journal for c in rig.clients]
    calls = tally(journals)
    exp = loop.figures
    report.figure("calls", calls.as_dict(), line=f"calls {json.dumps(calls.as_dict())}")
    report.figure("experiments", exp.as_dict(), line=f"experiments {json.dumps(exp.as_dict())}")
    report.figure("drained", drained, line=f"left after the clients stopped: {drained}")
    for name, death in exited.items():
        tail = "\n    ".join(death["log_tail"])
        line = f"{name} EXITED (code {death['exit_code']}) during the run; its log ends:"
        report.figure(f"exited.{name}", death, line=f"{line}\n    {tail}")
    adapters = {name: rig.adapter_dirs[name] for name in ADAPTERS}
    verdicts = verify(rig.model, adapters, calls.samples, exp.scored)
    for kind, verdict in verdicts.items():
        report.figure(f"verify_{kind}", verdict.as_dict(), line=(
            f"reference check, {kind}: {verdict.checked} rows, {verdict.wrong} wrong, max abs "
            f"diff {verdict.max_abs_diff:.2e}"))  # fmt: skip
    judged = [
        flatness(n, p, floor_of(n), breaks=monitor.restarts.get(n, ()))
        for n, p in sorted(monitor.series.items())
    ]
    for series in judged:
        report.figure(f"series.{series.name}", series.as_dict(), line=series.line())
    report.figure("series", monitor.to_json(), line=f"{len(judged)} series, {monitor.errors} "
                  "samples skipped while a Redis was down")  # fmt: skip
    start = monitor.started
    rates = recovery.rates(answered_times(journals), start, start + args.minutes * 60)
    recovered = recovery.recoveries(rates, faults, start)
    kinds = recovery.by_kind(recovered)
    report.figure("recovery", recovered, line=f"recovery per kind: {json.dumps(kinds)}")
    report.figure("rates", rates, line=f"{len(rates)} throughput buckets")
    png = args.out_dir / f"{report.name}.png"
    plot(rates, monitor.series, faults, start, png, _title(args, calls, len(faults)))
    lost = calls.lost + exp.missing_rows + exp.stuck + int(drained["request_entries"])
    duplicated = calls.duplicated + exp.duplicated_rows
    wrong = sum(v.wrong for v in verdicts.values())
    rising = [v.name for v in judged if not v.flat]
    failed = exp.submitted - exp.complete - exp.stuck  # ended failed or cancelled
    ratios = {
        "lost": lost, "duplicated": duplicated, "wrong": wrong, "rising": len(rising),
        "stuck_pending": int(drained["pending_entries"]), "experiments_failed": failed,
        "exited": len(exited),
    }  # fmt: skip
    flat = f"{len(judged) - len(rising)}/{len(judged)} series flat"
    flat += f" (rising: {', '.join(rising)})" if rising else ""
    summary = (
        f"soak {args.minutes:g} min{' (cluster)' if args.cluster else ''}: {calls.calls} calls, "
        f"{calls.answered} answered, lost {lost}, duplicated {duplicated}, wrong {wrong} "
        f"(of {sum(v.checked for v in verdicts.values())} checked), errors {calls.errors or 0}, "
        f"abandoned {calls.abandoned}; experiments {exp.complete}/{exp.submitted} complete "
        f"({failed} failed); "
        f"{flat}; "
        + (f"EXITED: {', '.join(exited)}; " if exited else "")
        + f"{len(faults)} faults; plot {png}  "
        "[target: lost 0, duplicated 0, wrong 0, 0 failed, all flat, none exited]"
    )  # fmt: skip
    result = report.finish(ratios, summary, args.out_dir)
    result["passed"] = not (
        lost or duplicated or wrong or rising or failed or drained["pending_entries"] or exited
    )
    return result


def _title(args: argparse.Namespace, calls: Any, faults: int) -> str:
    where = "3-master Redis Cluster" if args.cluster else "one Redis (AOF)"
    return (f"lmq bench soak: {args.minutes:g} min on {where}, 2 hf workers, 3 tenants, "
            f"{faults} faults; {calls.answered} calls answered, lost {calls.lost}")  # fmt: skip
