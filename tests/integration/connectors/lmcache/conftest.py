"""Real LMCache objects on the CPU wired to live daemons, and the redis-server fixture."""

from __future__ import annotations

import asyncio
import importlib.util
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

_path = Path(__file__).parents[3] / "unit" / "cluster" / "conftest.py"
_spec = importlib.util.spec_from_file_location("kvf_cluster_fixtures_lmcache", _path)
assert _spec is not None and _spec.loader is not None
_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fixtures)

redis_server = _fixtures.redis_server


@pytest.fixture
def lmcache_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """The event loop thread LMCache's storage backends run their coroutines on."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()

