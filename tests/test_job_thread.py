"""JobThread runs a loop's blocking jobs in order; serial_torch touches one thread only."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from lmqueue.shared.job_thread import JobThread
from lmqueue.shared.serial_torch import serial_here, serial_torch, serial_torch_here


async def test_jobs_run_in_order_off_the_loop_and_errors_reach_the_caller() -> None:
    jobs = JobThread("test-jobs")
    ran: list[tuple[int, str]] = []

    def job(n: int) -> int:
        time.sleep(0.01 * (3 - n))  # the first is slowest: order still holds
        ran.append((n, threading.current_thread().name))
        return n * 10

    def fails() -> None:
        raise ValueError("from the thread")

    try:
        results = await asyncio.gather(*(jobs.run(job, n) for n in range(3)))
        with pytest.raises(ValueError, match="from the thread"):
            await jobs.run(fails)
        assert await jobs.run(job, 2) == 20  # the thread outlives a failed job
    finally:
        jobs.close()
    assert results == [0, 10, 20]
    assert [n for n, _ in ran] == [0, 1, 2, 2] and {name for _, name in ran} == {"test-jobs"}


async def test_a_cancelled_job_runs_on_and_close_ends_the_thread_after_the_queue() -> None:
    jobs = JobThread("test-close")
    started, closed = threading.Event(), threading.Event()
    future = jobs.submit(lambda: (started.set(), time.sleep(0.1)))
    future.cancel()
    jobs.close(last=closed.set)
    assert not jobs.running
    assert await asyncio.to_thread(closed.wait, 5)
    assert started.is_set()
    assert await jobs.run(lambda: 7) == 7  # a later job starts a new thread
    jobs.close()


def test_serial_torch_here_changes_the_calling_thread_only() -> None:
    seen: dict[str, object] = {}

    def own_thread() -> None:
        seen["serial"] = serial_torch_here()
        seen["threads"] = torch.get_num_threads()

    before = torch.get_num_threads()
    thread = threading.Thread(target=own_thread)
    thread.start()
    thread.join()
    fresh: list[int] = []
    later = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    later.start()
    later.join()
    assert seen == {"serial": True, "threads": 1}
    assert torch.get_num_threads() == before and fresh == [before]


def test_serial_torch_restores_the_team_size_after_the_block() -> None:
    before = torch.get_num_threads()
    with serial_torch() as serial:
        assert serial and serial_here()
    assert torch.get_num_threads() == before
