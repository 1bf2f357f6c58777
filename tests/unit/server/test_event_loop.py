"""The daemon's event loop: uvloop's where it is installed, asyncio's where it is not."""

from __future__ import annotations

import asyncio
import sys

import pytest

from kvfabric.server.daemon import event_loop_factory


def _loop_module() -> str:
    loop = event_loop_factory()()
    try:
        return type(loop).__module__
    finally:
        loop.close()


def test_the_daemon_runs_on_uvloop_when_it_is_installed() -> None:
    pytest.importorskip("uvloop")
    assert _loop_module().startswith("uvloop")


def test_without_uvloop_the_daemon_runs_on_asyncios_own_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert _loop_module().startswith("asyncio")
    assert event_loop_factory() is asyncio.new_event_loop
