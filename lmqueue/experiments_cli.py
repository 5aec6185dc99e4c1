"""``lmq experiment``: submit, watch, cancel and collect experiments (see producer.Experiments).

    lmq experiment submit KIND --model M [--params FILE.json] [--set key=value ...]
                          [--data FILE.jsonl] [--id ID] [--at TIME | --in DURATION]
    lmq experiment status ID [--follow]
    lmq experiment list
    lmq experiment cancel ID
    lmq experiment results ID [-o FILE]

The tenant is the user of ``--redis-url`` (else ``default``); ``--tenant`` acts for another
tenant, which Redis allows only to a user with access to its keys (the operator).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import re
import sys
from pathlib import Path
from typing import Any

from lmqueue.shared.errors import BadRequest, SettingsError

__all__ = ["add_arguments", "run", "parse_duration_s", "parse_time_s", "build_params"]

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd]?)$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration_s(text: str) -> float:
    """``90``, ``90s``, ``5m``, ``2h``, ``1d`` -> seconds."""
    match = _DURATION.match(text.strip())
    if not match:
        raise SettingsError(f"--in {text!r}: expected a number with s, m, h or d (e.g. 10m)")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def parse_time_s(text: str) -> float:
    """An ISO 8601 time (UTC unless it names its offset) -> epoch seconds."""
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise SettingsError(f"--at {text!r}: expected an ISO time, e.g. 2026-11-24T03:00") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return when.timestamp()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``experiment`` subcommands and their flags."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--redis-url", default=None, help="default: $LMQ_REDIS_URL")
    common.add_argument("--tenant", default=None, help="default: the URL's user, else default")
    verbs = parser.add_subparsers(dest="verb", required=True)
    submit = verbs.add_parser("submit", parents=[common], help="submit an experiment")
    submit.add_argument("kind", help="score, sample, smc, or a kind the scheduler registers")
    submit.add_argument("--model", default="")
    submit.add_argument("--params", type=Path, help="a JSON file of parameters")
    submit.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    submit.add_argument("--data", type=Path, help="JSON Lines rows, as params.rows (score)")
    submit.add_argument("--id", default=None, help="the experiment id (submitting twice: once)")
    when = submit.add_mutually_exclusive_group()
    when.add_argument("--at", default=None, help="start at this ISO time (UTC by default)")
    when.add_argument("--in", dest="in_", default=None, help="start after 30s, 10m, 2h, ...")
    status = verbs.add_parser("status", parents=[common], help="show an experiment's status")
    status.add_argument("id")
    status.add_argument("--follow", action="store_true", help="progress bar until it finishes")
    status.add_argument("--json", action="store_true")
    listing = verbs.add_parser("list", parents=[common], help="list the tenant's experiments")
    listing.add_argument("--json", action="store_true")
    cancel = verbs.add_parser("cancel", parents=[common], help="stop an experiment")
    cancel.add_argument("id")
    results = verbs.add_parser("results", parents=[common], help="print result rows (JSONL)")
    results.add_argument("id")
    results.add_argument("-o", "--output", type=Path, default=None)


def build_params(args: argparse.Namespace) -> dict[str, Any]:
    """Parameters from ``--params``, ``--data`` and ``--set`` (in that order, later wins)."""
    params: dict[str, Any] = {}
    if args.params is not None:
        loaded = _json(args.params.read_text(), f"--params {args.params}")
        if not isinstance(loaded, dict):
            raise BadRequest(f"--params {args.params}: expected a JSON object")
        params.update(loaded)
    if args.data is not None:  # an unreadable file: OSError naming it (exit 2)
        lines = args.data.read_text().splitlines()
        params["rows"] = [
            _json(line, f"--data {args.data} line {number}")
            for number, line in enumerate(lines, 1)
            if line.strip()
        ]
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SettingsError(f"--set {item!r}: expected KEY=VALUE")
        try:
            params[key] = json.loads(value)
        except ValueError:
            params[key] = value  # a plain string
    return params


def _json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise BadRequest(f"{where}: not JSON ({exc})") from None


def run(args: argparse.Namespace) -> int:
    """Run one ``lmq experiment`` verb; the exit code."""
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    from lmqueue.producer.experiments import Experiments

    async with Experiments.connect(args.redis_url, tenant=args.tenant) as experiments:
        if args.verb == "submit":
            start = parse_time_s(args.at) if args.at else None
            if args.in_:
                start = datetime.datetime.now(datetime.UTC).timestamp() + parse_duration_s(args.in_)
            experiment_id = await experiments.submit(
                args.kind,
                build_params(args),
                model=args.model,
                experiment_id=args.id,
                start_after_s=start,
            )
            print(experiment_id)
        elif args.verb == "status":
            await _status(experiments, args)
        elif args.verb == "list":
            for status in await experiments.list():
                print(json.dumps(status.to_json()) if args.json else status.line())
        elif args.verb == "cancel":
            print((await experiments.cancel(args.id)).line())
        else:
            await _results(experiments, args)
    return 0


async def _status(experiments: Any, args: argparse.Namespace) -> None:
    if not args.follow:
        status = await experiments.status(args.id)
        print(json.dumps(status.to_json()) if args.json else status.line())
        return
    from tqdm import tqdm

    with tqdm(desc=args.id, unit="it", dynamic_ncols=True, file=sys.stderr) as bar:
        async for status in experiments.follow(args.id, 0.5):
            bar.total = status.total or None
            bar.n = status.done
            bar.set_postfix_str(status.status, refresh=False)
            bar.refresh()
    print(status.line())


async def _results(experiments: Any, args: argparse.Namespace) -> None:
    rows = await experiments.results(args.id)
    lines = "".join(json.dumps(row) + "\n" for row in rows)
    if args.output is None:
        sys.stdout.write(lines)
    else:
        args.output.write_text(lines)
        print(f"{len(rows)} rows -> {args.output}", file=sys.stderr)
