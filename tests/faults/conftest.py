"""Fixtures of the fault suite: a fresh redis-server per test, worker processes, figures."""

from __future__ import annotations

import gc
import json
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lmqueue.devstack import LocalCluster, LocalRedis, WorkerProcess, wait_live
from lmqueue.workers.backends.mock import MockAsyncLM

from .harness import MODEL, Figures

#: Settings every fault-test worker gets unless a test overrides them: fast heartbeats.
WORKER_ENV = {"LMQ_HEARTBEAT_S": "0.5", "LMQ_LOG_LEVEL": "INFO"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test of this directory `scenario`: `make test` leaves them to CI."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.scenario)


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Collect what redis-py's cluster client dropped unclosed (node objects, their stream
    writers) before pytest's own last collection reports leftover unraisable exceptions:
    their ResourceWarnings ("loop is closed"), raised as errors once the last test and its
    event loop are gone, failed sessions whose tests had all passed. Those collected earlier,
    while the session's fixtures are torn down, are still reported (a session running one
    cluster scenario file alone then exits 1 after its tests passed; within a longer session
    the next test's warning filters judge them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Keep each phase's report on the item, so fixtures can tell a failed test."""
    outcome = yield
    setattr(item, f"report_{call.when}", outcome.get_result())


@pytest.fixture
def fault_redis() -> Iterator[LocalRedis]:
    """A redis-server of this test's own: tests kill and restart it."""
    with LocalRedis() as server:
        yield server


@pytest.fixture
def fault_cluster() -> Iterator[LocalCluster]:
    """A Redis Cluster of this test's own (3 masters, a replica each): tests kill and reshard it."""
    with LocalCluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def reference(smol_tokenizer: Any) -> MockAsyncLM:
    """The in-process backend whose results every answer must equal, bit for bit."""
    return MockAsyncLM(smol_tokenizer)


class WorkerPool:
    """Worker processes of one test; `spawn` waits until they serve."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.workers: list[WorkerProcess] = []

    def spawn(
        self,
        redis_url: str,
        count: int = 2,
        *,
        backend_opts: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        prefix: str = "w",
    ) -> list[WorkerProcess]:
        """Start `count` mock workers named ``<prefix><i>`` and wait until each is live."""
        started = [
            WorkerProcess(MODEL, "mock", redis_url, f"{prefix}{i}", backend_opts,
                          {**WORKER_ENV, **(env or {})}, log_dir=self.log_dir).start()
            for i in range(count)
        ]  # fmt: skip
        self.workers += started
        wait_live(redis_url, MODEL, started)
        return started

    def restart(self, redis_url: str, worker: WorkerProcess) -> None:
        """Start a dead worker again under its name (as a supervisor would)."""
        worker.start()

    def stop_all(self) -> None:
        for worker in self.workers:
            worker.stop(timeout_s=10)

    def logs(self) -> str:
        return "\n".join(f"--- {w.name}\n{w.log()[-4000:]}" for w in self.workers)


@pytest.fixture
def workers(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[WorkerPool]:
    """Start worker processes with `workers.spawn(...)`; all are stopped after the test."""
    pool = WorkerPool(tmp_path)
    yield pool
    pool.stop_all()
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        print(pool.logs())


@pytest.fixture(scope="session")
def _all_figures(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    collected: list[dict[str, Any]] = []
    yield collected
    if not collected:
        return
    target = os.environ.get("LMQ_FAULT_FIGURES") or str(
        tmp_path_factory.getbasetemp() / "fault-figures.json"
    )
    Path(target).write_text(json.dumps(collected, indent=2))
    print(f"\nfault figures written to {target}")


@pytest.fixture
def record(_all_figures: list[dict[str, Any]]) -> Callable[[Figures], None]:
    """Print a scenario's figures and keep them for the session's JSON file."""

    def keep(figures: Figures) -> None:
        print(f"\nFIGURES {figures.line()}")
        _all_figures.append(figures.as_dict())

    return keep
