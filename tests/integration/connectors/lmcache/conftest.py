"""Real LMCache objects on the CPU wired to live daemons."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest


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
