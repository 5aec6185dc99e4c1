"""``lmq scheduler`` (also ``python -m lmqueue.scheduler``): run one scheduler process.

    lmq scheduler --redis-url redis://127.0.0.1:6379/0 [--control-url URL] [--config FILE]
                  [--max-jobs N] [--max-running-per-tenant N] [--kind NAME=module:function]

Start more processes to run more experiments at once; stop one with SIGTERM or Ctrl-C (its
running experiments go back to the queue and resume from their checkpoints elsewhere).
When the data Redis (``--redis-url``) is a Redis Cluster, ``--control-url`` (or
``LMQ_CONTROL_URL``) names the single instance for arq's and the scheduler's own keys.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from lmqueue.shared.errors import SettingsError
from lmqueue.shared.failures import ArgumentParser, configure_logging, report_failure
from lmqueue.shared.settings import configured_control_url, configured_redis_url

from .arq_worker import serve
from .settings import SchedulerSettings

__all__ = ["add_arguments", "run", "main", "settings_from_args"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The scheduler's flags."""
    parser.add_argument("--redis-url", default=None, help="the data plane; default: $LMQ_REDIS_URL")
    parser.add_argument(
        "--control-url", default=None,
        help="single instance for arq and the scheduler's keys; default: $LMQ_CONTROL_URL, "
        "else --redis-url (which must then be a single instance)",
    )  # fmt: skip
    parser.add_argument("--config", default=None, help="JSON file of SchedulerSettings fields")
    parser.add_argument("--name", default=None, help="this process's consumer name")
    parser.add_argument("--max-jobs", type=int, default=None, help="experiments at once here")
    parser.add_argument("--max-running-per-tenant", type=int, default=None)
    parser.add_argument("--lease-s", type=float, default=None)
    parser.add_argument(
        "--kind", action="append", default=[], metavar="NAME=MODULE:FUNCTION",
        help="register a custom kind (repeatable)",
    )  # fmt: skip
    parser.add_argument("--log-level", default="INFO")


def settings_from_args(args: argparse.Namespace) -> SchedulerSettings:
    """`SchedulerSettings` from the config file, the flags on top."""
    kinds = {}
    for spec in args.kind:
        name, sep, target = spec.partition("=")
        if not sep:
            name, target = spec, spec
        kinds[name] = target
    settings = SchedulerSettings.load(
        args.config,
        redis_url=args.redis_url or configured_redis_url(),
        control_url=args.control_url or configured_control_url(),
        name=args.name,
        max_jobs=args.max_jobs,
        max_running_per_tenant=args.max_running_per_tenant,
        lease_s=args.lease_s,
    )
    if kinds:
        settings = SchedulerSettings.load(
            None, **{**settings.__dict__, "kinds": {**settings.kinds, **kinds}}
        )
    return settings


def run(args: argparse.Namespace) -> int:
    """Run the scheduler until interrupted; the exit code."""
    level = str(args.log_level).upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise SettingsError(f"--log-level {args.log_level!r}: expected DEBUG, INFO, WARNING, ...")
    configure_logging(level, "%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(settings_from_args(args)))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m lmqueue.scheduler``."""
    parser = ArgumentParser(prog="lmq scheduler", description=__doc__)
    add_arguments(parser)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (Exception, KeyboardInterrupt) as exc:
        return report_failure("lmq scheduler", exc, args.verbose)


if __name__ == "__main__":
    sys.exit(main())
