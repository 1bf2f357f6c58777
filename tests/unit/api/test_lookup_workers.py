"""Lookup bodies parsed by worker processes (kvfabric.api.lookup_workers): the same answers
and errors as parsing in the daemon's process, for a fraction of its CPU; dead, stuck and
closed workers. Real worker processes over their socketpair."""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import resource
import signal
import threading
import time

import numpy as np
import pytest

from kvfabric.api.app import LookupRequest
from kvfabric.api.lookup_body import BodyInvalid, BodyTooLarge, parse_lookup
from kvfabric.api.lookup_workers import IN_PROCESS_BYTES, LookupParsers
from kvfabric.errors import UnavailableError

NS = {"model": "m", "spec": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8}}
LIMITS = {"max_tokens": 1 << 20, "max_hashes": 1 << 16, "hash_chars": 32}


@pytest.fixture
def parsers():
    made: list[LookupParsers] = []

    def make(workers: int = 1, **kwargs) -> LookupParsers:
        made.append(LookupParsers(workers, **LIMITS, **kwargs))
        return made[-1]

    yield make
    for p in made:
        p.close()


def parse(p: LookupParsers, raw: bytes):
    return asyncio.run(p.parse(raw, LookupRequest))


def outcome(call):
    """What a parse gives: the model's fields (token ids as a list), or the error's."""
    try:
        body = call()
    except BodyInvalid as exc:
        return ("invalid", exc.issues, exc.total)
    except BodyTooLarge as exc:
        return ("too_large", str(exc))
    fields = body.model_dump(exclude={"token_ids"})
    fields["token_ids"] = None if body.token_ids is None else list(map(int, body.token_ids))
    return ("ok", fields)


BODIES = {
    "tokens": {"namespace": NS, "token_ids": list(range(-5000, 45_000))},
    "hashes": {
        "namespace": NS,
        "chunk_hashes": [f"{i:032x}" for i in range(5000)],
        "scope": "cluster",
    },
    "bad_ids": {"namespace": NS, "token_ids": [1 << 40] * 200_000},
    "some_bad": {"namespace": NS, "token_ids": [1] * 12000 + [True, 2.5, "x", 1 << 31]},
    "bad_hashes": {"namespace": NS, "chunk_hashes": ["zz" * 16] * 3000},
    "too_many": {"namespace": NS, "token_ids": [7] * ((1 << 20) + 1)},
    "both": {"namespace": NS, "token_ids": [1] * 12000, "chunk_hashes": ["00" * 16]},
    "bad_namespace": {"namespace": {"model": ""}, "token_ids": [1] * 12000},
    "extra_field": {"namespace": NS, "token_ids": [1] * 12000, "x" * 40000: 1},
}


@pytest.mark.parametrize("name", sorted(BODIES))
def test_a_worker_answers_as_the_daemon_would(parsers, name: str) -> None:
    raw = json.dumps(BODIES[name]).encode()
    assert len(raw) > IN_PROCESS_BYTES  # these go to a worker
    p = parsers(1)
    in_process = outcome(lambda: parse_lookup(raw, LookupRequest, **LIMITS))
    assert outcome(lambda: parse(p, raw)) == in_process
    assert len(p.pids()) == 1


def test_malformed_json_and_a_non_object_are_refused_alike(parsers) -> None:
    p = parsers(1)
    for raw in (
        b"[" * 40000,
        b'{"token_ids": [' + b"1," * 20000 + b"]}",
        json.dumps([1] * 20000).encode(),
        b"\xff" * 40000,
    ):
        assert outcome(lambda: parse(p, raw)) == outcome(  # noqa: B023 (called at once)
            lambda: parse_lookup(raw, LookupRequest, **LIMITS)  # noqa: B023
        )


def test_token_ids_come_back_as_an_int32_array_and_small_bodies_stay_here(parsers) -> None:
    p = parsers(1)
    body = parse(p, json.dumps(BODIES["tokens"]).encode())
    assert isinstance(body.token_ids, np.ndarray) and body.token_ids.dtype == np.int32
    small = parse(p, json.dumps({"namespace": NS, "token_ids": [1, 2, 3]}).encode())
    assert small.token_ids == [1, 2, 3]
    assert p.pids() == [p.pids()[0]]  # the small one needed no worker of its own


PARSED_HERE: contextvars.ContextVar[bool] = contextvars.ContextVar("parsed_here", default=False)


def test_run_parses_a_small_body_and_answers_in_the_same_hop_off_the_loop(
    parsers, monkeypatch
) -> None:
    """A hop off the loop runs in a copy of the loop's context: what the parse set is seen
    by the answer only when both ran in one hop."""
    p = parsers(1)

    def parse_here(*args, **kwargs):
        PARSED_HERE.set(True)
        return parse_lookup(*args, **kwargs)

    def answer(body: LookupRequest) -> tuple[int, bool, int]:
        tokens = 0 if body.token_ids is None else len(body.token_ids)
        return tokens, PARSED_HERE.get(), threading.get_ident()

    async def run(raw: bytes) -> tuple[tuple[int, bool, int], int]:
        return await p.run(raw, LookupRequest, answer), threading.get_ident()

    monkeypatch.setattr("kvfabric.api.lookup_workers.parse_lookup", parse_here)
    small = json.dumps({"namespace": NS, "token_ids": [1, 2]}).encode()
    (tokens, same_hop, thread), loop = asyncio.run(run(small))
    assert (tokens, same_hop) == (2, True) and thread != loop
    assert p.pids() == []  # no worker for it
    (tokens, same_hop, thread), loop = asyncio.run(run(json.dumps(BODIES["tokens"]).encode()))
    assert tokens == len(BODIES["tokens"]["token_ids"])
    assert not same_hop and thread != loop  # parsed by the worker process
    assert len(p.pids()) == 1


def test_a_million_bad_ids_cost_this_process_a_fraction_of_parsing_them_here(parsers) -> None:
    """Regression: on the old code the daemon's own threads parsed and checked the body:
    about a second of its CPU (and GIL) per request, which delayed every control round trip
    (ping p99 126-295 ms under a stream of them)."""
    raw = json.dumps({"namespace": NS, "token_ids": [1 << 40] * 1_000_000}).encode()
    p = parsers(1)
    parse(p, json.dumps(BODIES["tokens"]).encode())  # the worker is up

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    start = cpu()
    with pytest.raises(BodyInvalid):
        parse_lookup(raw, LookupRequest, **LIMITS)
    here = cpu() - start
    start = cpu()
    with pytest.raises(BodyInvalid) as info:
        parse(p, raw)
    there = cpu() - start
    assert info.value.total == 1_000_000 and len(info.value.issues) == 10
    assert there < here / 4, (there, here)


def test_a_killed_worker_fails_its_request_and_is_replaced(parsers) -> None:
    p = parsers(1)
    raw = json.dumps({"namespace": NS, "token_ids": [1 << 40] * 1_000_000}).encode()
    parse(p, json.dumps(BODIES["tokens"]).encode())
    (first,) = p.pids()
    failed: list[BaseException] = []

    def busy() -> None:
        try:
            p.parse_blocking(raw)
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=busy)
    thread.start()
    time.sleep(0.05)  # it is sending or parsing the 15 MB body
    os.kill(first, signal.SIGKILL)
    thread.join(30)
    assert len(failed) == 1 and isinstance(failed[0], (UnavailableError, BodyInvalid)), failed
    # a worker that died while idle is replaced too
    parse(p, json.dumps(BODIES["tokens"]).encode())
    (second,) = p.pids()
    os.kill(second, signal.SIGKILL)
    time.sleep(0.2)
    assert outcome(lambda: parse(p, json.dumps(BODIES["tokens"]).encode()))[0] == "ok"
    assert p.pids() and second not in p.pids() and first not in p.pids()


def test_a_stuck_worker_is_killed_at_its_deadline(parsers) -> None:
    p = parsers(1, answer_s=1.0)
    parse(p, json.dumps(BODIES["tokens"]).encode())
    (stuck,) = p.pids()
    os.kill(stuck, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(UnavailableError):
            parse(p, json.dumps(BODIES["tokens"]).encode())
        assert time.monotonic() - started < 5
    finally:
        try:
            os.kill(stuck, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert stuck not in p.pids()
    assert outcome(lambda: parse(p, json.dumps(BODIES["tokens"]).encode()))[0] == "ok"


def test_close_ends_the_workers_and_refuses_more(parsers) -> None:
    p = parsers(2)
    raw = json.dumps(BODIES["tokens"]).encode()

    async def two() -> None:
        await asyncio.gather(
            p.parse(raw, LookupRequest), p.parse(raw, LookupRequest), p.parse(raw, LookupRequest)
        )

    asyncio.run(two())
    pids = p.pids()
    assert 1 <= len(pids) <= 2
    p.close()
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reaped: gone
    with pytest.raises(UnavailableError):
        parse(p, raw)


def test_a_worker_process_imports_neither_pydantic_nor_asyncio_nor_prometheus() -> None:
    """A worker starts in ~0.1 s and ~14 MB: the module it runs (and its package) pull in
    nothing heavy at import (they pulled in pydantic and prometheus_client: 0.8 s, 33 MB)."""
    import subprocess
    import sys

    code = (
        "import sys, kvfabric.api.lookup_workers; print(sorted({m.split('.')[0] for m in "
        "sys.modules} & {'pydantic', 'asyncio', 'numpy', 'prometheus_client', 'anyio', "
        "'fastapi'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_idle_workers_end_and_come_back_when_needed(parsers) -> None:
    """An idle daemon holds no parser process (nor its descriptor, nor what a million-id
    body left in its memory)."""
    p = parsers(2, idle_s=0.5)
    raw = json.dumps(BODIES["tokens"]).encode()

    async def use_then_idle() -> list[int]:
        await asyncio.gather(p.parse(raw, LookupRequest), p.parse(raw, LookupRequest))
        before = p.pids()
        await asyncio.sleep(1.5)  # the loop runs the idle check meanwhile
        return before

    before = asyncio.run(use_then_idle())
    assert before and p.pids() == []
    time.sleep(1.0)  # stop() reaps them on a thread
    for pid in before:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    assert outcome(lambda: parse(p, raw))[0] == "ok" and len(p.pids()) == 1
