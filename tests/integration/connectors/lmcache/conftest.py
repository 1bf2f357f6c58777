"""Real LMCache objects on the CPU wired to live daemons."""

from __future__ import annotations

import asyncio
import os
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


@pytest.fixture(autouse=True)
def lmcache_leaves_the_environment_alone() -> Iterator[None]:
    """LMCache's PrometheusLogger sets PROMETHEUS_MULTIPROC_DIR in the process environment;
    every daemon a later test started inherited it, and its prometheus_client then held
    mmap files open in /tmp/lmcache_prometheus (the chaos suite's descriptor-leak check
    counted them when it ran after these tests). Put the variable back as it was."""
    before = os.environ.get(MULTIPROC_DIR)
    yield
    if before is None:
        os.environ.pop(MULTIPROC_DIR, None)
    else:
        os.environ[MULTIPROC_DIR] = before


MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"
