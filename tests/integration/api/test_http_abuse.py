"""The HTTP plane under abuse, on a real daemon: slowloris connections are closed at the
configured deadline, an oversized or million-bad-id lookup is refused without stalling the
control socket, one source address cannot take every connection, and meanwhile control
pings and /healthz stay fast."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable

import httpx
from scrape import sample, scrape

from kvfabric.client import Client

NS = {"model": "m", "spec": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8}}
DEADLINE_S = 2.0


def pings(socket_path: str, until: Callable[[], bool], min_count: int = 50) -> list[float]:
    """Control-plane round trips (seconds) until ``until()`` and at least ``min_count``."""
    out: list[float] = []
    with Client(socket_path) as client:
        while len(out) < min_count or not until():
            start = time.perf_counter()
            client.ping()
            out.append(time.perf_counter() - start)
            time.sleep(0.005)
    return out


def p99(samples: list[float]) -> float:
    return sorted(samples)[int(0.99 * (len(samples) - 1))]


def closed_by_server(sock: socket.socket) -> bool:
    try:
        sock.setblocking(False)
        data = sock.recv(4096)
    except BlockingIOError:
        return False
    except ConnectionError:
        return True
    return data == b"" or data.startswith(b"HTTP/1.1 408")


def test_slowloris_connections_are_closed_at_the_deadline(start_daemon) -> None:
    """300 slowloris requests from 127.0.0.1 (64 admitted, the rest refused by
    ``limits.http_max_connections_per_ip`` but as silent until the deadline) are all closed
    by it, while /healthz from another address (127.0.0.2) and control pings stay fast.

    Regression: on the old code (h11 without a read deadline) 300 slowloris requests
    stayed open past 90 s."""
    daemon = start_daemon(f"limits.http_request_timeout_s={DEADLINE_S}")
    port = daemon.info["http_port"]
    loris = []
    for _ in range(300):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # headers never end
        loris.append(sock)
    opened = time.monotonic()
    stop = threading.Event()

    def trickle() -> None:  # one more header byte per socket every 0.5 s
        while not stop.wait(0.5):
            for sock in loris:
                try:
                    sock.send(b"X")
                except OSError:
                    pass

    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    health: list[float] = []
    try:
        all_closed = lambda: all(closed_by_server(s) for s in loris)  # noqa: E731
        other = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(timeout=5, transport=other) as http:

            def closed_or_late() -> bool:
                start = time.perf_counter()
                assert http.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
                health.append(time.perf_counter() - start)
                late = time.monotonic() - opened > DEADLINE_S + 5
                return late or (time.monotonic() - opened > DEADLINE_S + 1 and all_closed())

            samples = pings(daemon.socket, closed_or_late)
        assert all_closed(), "slowloris sockets outlived the deadline"
        assert time.monotonic() - opened < DEADLINE_S + 5
    finally:
        stop.set()
        trickler.join()
        for sock in loris:
            sock.close()
    assert p99(samples) < 0.1, sorted(samples)[-5:]
    assert max(health) < 1.0, sorted(health)[-5:]


def test_an_idle_connection_that_never_sends_is_closed_too(start_daemon) -> None:
    daemon = start_daemon(f"limits.http_request_timeout_s={DEADLINE_S}")
    with socket.create_connection(("127.0.0.1", daemon.info["http_port"]), timeout=5) as sock:
        sock.settimeout(DEADLINE_S + 3)
        start = time.monotonic()
        assert sock.recv(4096).startswith(b"HTTP/1.1 408")
        assert DEADLINE_S - 0.5 < time.monotonic() - start < DEADLINE_S + 2


def test_a_million_bad_token_ids_do_not_stall_the_control_socket(start_daemon) -> None:
    """Regression: on the old code this one request (validated on the daemon's only event
    loop) stalled every control round trip for 13 s; 3 M ids took minutes and 3.7 GB."""
    daemon = start_daemon()
    bad = json.dumps({"namespace": NS, "token_ids": [1 << 40] * 1_000_000}).encode()
    huge = json.dumps({"namespace": NS, "token_ids": [7] * 3_000_000}).encode()
    results: dict[str, httpx.Response] = {}

    def post(name: str, body: bytes) -> None:
        results[name] = httpx.post(
            f"{daemon.http_url}/v1/lookup",
            content=body,
            timeout=60,
            headers={"Content-Type": "application/json"},
        )

    senders = [
        threading.Thread(target=post, args=(n, b)) for n, b in (("bad", bad), ("huge", huge))
    ]
    for sender in senders:
        sender.start()
    started = time.monotonic()
    samples = pings(daemon.socket, lambda: not any(s.is_alive() for s in senders))
    took = time.monotonic() - started
    assert took < 30  # old code: 13 s for the first, minutes for the second
    assert results["bad"].status_code == 422
    assert results["bad"].json()["error"]["message"].endswith("and 999990 more")
    assert results["huge"].status_code == 413  # 3 M ids: over limits.lookup_max_tokens
    assert max(samples) < 0.5, sorted(samples)[-5:]  # old code: 13 s
    assert p99(samples) < 0.1, sorted(samples)[-5:]


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process (its threads; not its children)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except OSError:
                pass
    return found


def test_million_id_lookups_cost_the_daemon_process_a_fraction_of_parsing_them(
    start_daemon,
) -> None:
    """Three million-bad-id lookups, on a daemon with parse workers (the default) and on one
    parsing in its own threads (``limits.http_parse_workers=0``): the same 422 from both,
    and the first daemon's own process spends under a third of the CPU the second's does;
    its workers end with it.

    Regression: on the old code the daemon's threads parsed every body (about a second of
    its CPU and GIL each), and under a stream of them the chaos suite's control pings
    reached p99 126-295 ms."""
    bad = json.dumps({"namespace": NS, "token_ids": [1 << 40] * 1_000_000}).encode()
    spent = {}
    for workers in ("2", "0"):
        daemon = start_daemon(f"limits.http_parse_workers={workers}")
        url = f"{daemon.http_url}/v1/lookup"
        headers = {"Content-Type": "application/json"}
        first = httpx.post(url, content=bad, headers=headers, timeout=60)  # a worker starts
        assert first.status_code == 422
        assert first.json()["error"]["message"].endswith("and 999990 more")
        before = cpu_seconds(daemon.proc.pid)
        for _ in range(3):
            assert httpx.post(url, content=bad, headers=headers, timeout=60).status_code == 422
        spent[workers] = cpu_seconds(daemon.proc.pid) - before
        if workers != "0":
            workers_seen = children_of(daemon.proc.pid)
            assert workers_seen, "no parse worker process"
            assert daemon.stop() == 0
            for pid in workers_seen:
                assert (
                    not os.path.exists(f"/proc/{pid}")
                    or open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
                )
    assert spent["2"] < spent["0"] / 3, spent


def test_body_and_token_limits_are_settings(start_daemon) -> None:
    daemon = start_daemon("limits.http_max_body_bytes=4096", "limits.lookup_max_tokens=100")
    url = f"{daemon.http_url}/v1/lookup"
    over_bytes = httpx.post(url, json={"namespace": NS, "token_ids": list(range(2000))})
    assert over_bytes.status_code == 413 and over_bytes.json()["error"]["kind"] == "too_large"
    over_count = httpx.post(url, json={"namespace": NS, "token_ids": [1] * 101})
    assert over_count.status_code == 413 and "at most 100" in over_count.text
    ok = httpx.post(url, json={"namespace": NS, "token_ids": [1] * 100})
    assert ok.status_code == 200 and ok.json()["requested_tokens"] == 100


def connect_from(source: str, port: int) -> socket.socket:
    """A connection to the daemon's loopback HTTP port from ``source`` (any 127.x address:
    Linux routes all of 127.0.0.0/8 to lo, so each is a distinct client address)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def get_healthz(sock: socket.socket) -> tuple[int, bytes]:
    """One ``GET /healthz`` (``Connection: close``): the status and the body."""
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_one_address_cannot_take_every_http_connection(start_daemon) -> None:
    """127.0.0.1 holds its 4 connections and opens 20 more: each of those is answered 503
    (kind ``unavailable``, naming the setting) and counted, and takes no global slot: a
    client at 127.0.0.2 is still served under ``http_max_connections=8``. Once one of the
    first four closes, 127.0.0.1 is served again (the count follows closes).

    Regression: on the old code there was no per-address bound: the 20 extra connections of
    127.0.0.1 filled the 8 global slots and 127.0.0.2 got uvicorn's 503 as well."""
    daemon = start_daemon(
        "limits.http_max_connections_per_ip=4",
        "limits.http_max_connections=8",
        "limits.http_request_timeout_s=60",
    )
    port = daemon.info["http_port"]
    held = [connect_from("127.0.0.1", port) for _ in range(4)]  # silent: admitted, held
    flood = [connect_from("127.0.0.1", port) for _ in range(20)]
    try:
        for sock in flood[:-1]:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        status, body = get_healthz(flood[-1])
        assert status == 503, body
        error = json.loads(body)["error"]
        assert error["kind"] == "unavailable"
        assert "limits.http_max_connections_per_ip" in error["message"]
        for sock in flood[:-1]:  # every one refused, then closed by the daemon
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
            assert data.startswith(b"HTTP/1.1 503"), data[:200]
        with connect_from("127.0.0.2", port) as other:
            status, body = get_healthz(other)
        assert status == 200, body
        held.pop().close()
        refused, deadline = 20, time.monotonic() + 5
        while True:  # the daemon sees the close on its next loop turn
            with connect_from("127.0.0.1", port) as again:
                status, _ = get_healthz(again)
            if status == 200 or time.monotonic() > deadline:
                break
            refused += 1
            time.sleep(0.05)
        assert status == 200
        samples = scrape(daemon.http_url)  # from 127.0.0.1, in the freed slot
        assert (
            sample(
                samples,
                "kvfabric_control_connections_closed_total",
                listener="http",
                reason="per_ip_limit",
            )
            == refused
        )
    finally:
        for sock in held + flood:
            sock.close()
