"""The worker's event loop (`workers.event_loop`): uvloop's where installed, unless asked not.

The setting's effect on a real worker process is in tests/test_startup_line.py (its startup
line names the loop it runs on); here the choice itself, and uvloop missing.
"""

from __future__ import annotations

import asyncio
import builtins
from typing import Any

import pytest
import uvloop

from lmqueue.shared.errors import SettingsError
from lmqueue.workers.event_loop import loop_factory, loop_name, run_on


async def _running_loop_name() -> str:
    return loop_name(asyncio.get_running_loop())


def test_auto_and_uvloop_run_on_uvloop_and_asyncio_on_the_standard_loop() -> None:
    assert run_on("auto", _running_loop_name()) == "uvloop"
    assert run_on("uvloop", _running_loop_name()) == "uvloop"
    assert run_on("asyncio", _running_loop_name()) == "asyncio"
    assert loop_factory("auto") is uvloop.new_event_loop
    assert loop_factory("asyncio") is None


def test_without_uvloop_auto_falls_back_and_uvloop_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_import = builtins.__import__

    def no_uvloop(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "uvloop":
            raise ImportError("No module named 'uvloop'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_uvloop)
    assert loop_factory("auto") is None
    assert run_on("auto", _running_loop_name()) == "asyncio"
    with pytest.raises(SettingsError, match="uvloop is not installed"):
        run_on("uvloop", _running_loop_name())


def test_an_unknown_loop_is_refused_without_leaving_its_coroutine_unawaited() -> None:
    coroutine = _running_loop_name()
    with pytest.raises(SettingsError, match="event_loop='trio'"):
        run_on("trio", coroutine)
    assert coroutine.cr_frame is None  # closed, not left for the garbage collector to warn
