"""kvfabric.logfmt: one JSON object per line, with the request's fields where there is one."""

from __future__ import annotations

import asyncio
import contextvars
import io
import json
import logging
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvfabric.logfmt import (
    JsonFormatter,
    add_context,
    configure,
    current_context,
    formatter,
    request_context,
)


@pytest.fixture
def lines() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A logger of its own writing JSON into a buffer (the root logger stays pytest's)."""
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("kvfabric.test-logfmt")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    yield logger, buffer
    logger.removeHandler(handler)


def parsed(buffer: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


def test_a_line_is_one_json_object_with_the_fixed_fields(lines) -> None:
    logger, buffer = lines
    logger.warning("disk %s is %d%% full\nsecond line", "ssd0", 93)
    (line,) = parsed(buffer)  # a message with a newline stays one line of output
    assert line["level"] == "WARNING" and line["logger"] == "kvfabric.test-logfmt"
    assert line["message"] == "disk ssd0 is 93% full\nsecond line"
    assert line["time"].endswith("+00:00") and "T" in line["time"]
    assert not {"request_id", "op", "namespace", "tenant"} & set(line)  # no request here


def test_the_request_context_and_extra_fields_land_on_the_line(lines) -> None:
    logger, buffer = lines
    with request_context(request_id=7, op="get", tenant=None):
        add_context(namespace="llama-8b", tenant="team-a")
        logger.info("pinned")
        logger.info("overridden", extra={"op": "get_batch", "chunks": 3})
    logger.info("after")
    inside, overridden, after = parsed(buffer)
    fields = {k: inside.get(k) for k in ("request_id", "op", "namespace", "tenant")}
    assert fields == {"request_id": 7, "op": "get", "namespace": "llama-8b", "tenant": "team-a"}
    assert overridden["op"] == "get_batch" and overridden["chunks"] == 3
    assert "op" not in after and current_context() == {}


def test_add_context_outside_a_request_does_nothing() -> None:
    add_context(namespace="x")
    assert current_context() == {}


def test_exceptions_and_odd_values_still_make_one_object(lines) -> None:
    logger, buffer = lines
    try:
        raise ValueError("boom")
    except ValueError:
        logger.exception("failed", extra={"path": object()})
    (line,) = parsed(buffer)
    assert "ValueError: boom" in line["exception"] and line["path"].startswith("<object")


def test_the_context_follows_the_request_into_tasks_and_worker_threads(lines) -> None:
    """The control server's way: a task made inside the request keeps its fields, and an
    executor call run in a copy of the context logs them (and what it adds is shared)."""
    logger, buffer = lines

    async def main() -> None:
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1) as pool:
            with request_context(request_id=1, op="get") as context:
                task = asyncio.create_task(asyncio.sleep(0, "done"))

                def handler() -> None:
                    add_context(namespace="from-thread")
                    logger.info("in thread %s", threading.current_thread().name)

                await loop.run_in_executor(pool, contextvars.copy_context().run, handler)
            await task
            assert context["namespace"] == "from-thread"

    asyncio.run(main())
    (line,) = parsed(buffer)
    assert (line["request_id"], line["op"], line["namespace"]) == (1, "get", "from-thread")


def test_concurrent_requests_keep_their_own_fields(lines) -> None:
    logger, buffer = lines

    async def request(i: int) -> None:
        with request_context(request_id=i):
            await asyncio.sleep(0.001 * (3 - i))
            add_context(op=f"op{i}")
            logger.info("done")

    async def main() -> None:
        await asyncio.gather(*(request(i) for i in range(3)))

    asyncio.run(main())
    assert sorted((line["request_id"], line["op"]) for line in parsed(buffer)) == [
        (0, "op0"),
        (1, "op1"),
        (2, "op2"),
    ]


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="text, json"):
        formatter("yaml")


def test_configure_json_makes_every_stderr_line_an_object() -> None:
    """In a fresh interpreter: the root logger, warnings too (captured into logging)."""
    code = (
        "import logging, warnings\n"
        "from kvfabric.logfmt import configure\n"
        "configure(logging.INFO, 'json')\n"
        "logging.getLogger('kvfabric.x').info('hello')\n"
        "warnings.warn('careful')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    records = [json.loads(line) for line in done.stderr.splitlines()]
    assert records[0]["message"] == "hello" and records[0]["level"] == "INFO"
    assert records[1]["logger"] == "py.warnings" and "careful" in records[1]["message"]


def test_configure_without_force_leaves_existing_handlers_alone() -> None:
    root = logging.getLogger()
    before = list(root.handlers)
    if not before:
        pytest.skip("needs a configured root logger (pytest's)")
    configure(logging.DEBUG, "json", force=False)
    assert root.handlers == before
