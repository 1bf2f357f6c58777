"""The chaos harness's attacker: ``python chaos_workers.py flood CONFIG.json``.

For as long as it runs (until ``<workdir>/stop-<name>`` or ``<workdir>/stop``), against one
node:

* **control-socket flood** -- keeps ``connections`` Unix connections open that never finish
  a hello: idle ones, half-sent frames, a length prefix far over the pre-hello frame limit,
  hellos with a wrong token, garbage bytes; each one the daemon closes is opened again, at
  most ``reopen_per_s`` a second (the flood is about the daemon's connection slots; a local
  process burning CPU in a connect loop is a different attack no daemon can stop);
* **oversized HTTP** -- ``POST /v1/lookup`` with a million invalid token ids, three million
  ids (over ``limits.lookup_max_tokens``), the same without a token, and a request whose
  ``Content-Length`` claims a gigabyte, back to back on ``http_threads`` threads;
* **slowloris** -- ``slowloris`` HTTP connections trickling header bytes, reopened when
  closed.

The HTTP attacks come from loopback addresses of their own (:data:`OVERSIZED_FROM`,
:data:`SLOWLORIS_FROM`), as a remote attacker would: the harness's own HTTP calls (from
127.0.0.1) must get through ``limits.http_max_connections_per_ip`` beside them.

It touches ``<workdir>/<name>.flooding`` once the flood is established, and reports what it
did (connections opened, closed by the daemon, HTTP answers by status) as ``counts``.
"""

from __future__ import annotations

import json
import os
import resource
import selectors
import socket
import struct
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from chaos_common import Events, namespace

from kvfabric.protocol.frames import encode_frame
from kvfabric.protocol.messages import Op, encode_namespace, request

OVERSIZED_FROM = "127.0.0.3"
SLOWLORIS_FROM = "127.0.0.4"
MODES = ("idle", "half_frame", "big_header", "bad_hello", "garbage")


def _opening(mode: str) -> bytes:
    if mode == "half_frame":
        return struct.pack("<I", 1000) + b"x" * 10
    if mode == "big_header":
        return struct.pack("<I", 8 << 20) + b"\0" * 4096
    if mode == "bad_hello":
        return encode_frame(request(1, Op.HELLO, {"client": "flood", "token": "wrong"}))
    if mode == "garbage":
        return os.urandom(64)
    return b""


class Flood:
    def __init__(self, cfg: dict[str, Any], workdir: Path) -> None:
        self.cfg, self.workdir = cfg, workdir
        self.counts: Counter = Counter()
        self.lock = threading.Lock()
        self.stopped = threading.Event()

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counts[name] += n

    def should_stop(self) -> bool:
        if (self.workdir / f"stop-{self.cfg['name']}").exists() or (self.workdir / "stop").exists():
            self.stopped.set()
        return self.stopped.is_set()

    def control(self) -> None:
        selector = selectors.DefaultSelector()
        opened, n = 0, self.cfg["connections"]
        flooding = self.workdir / f"{self.cfg['name']}.flooding"
        started = time.monotonic()
        if n == 0:
            flooding.touch()
        budget, refill = float(n), time.monotonic()
        while not self.should_stop():
            now = time.monotonic()
            budget = min(float(n), budget + (now - refill) * self.cfg["reopen_per_s"])
            refill = now
            while len(selector.get_map()) < n and budget >= 1:
                budget -= 1
                mode = MODES[opened % len(MODES)]
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.setblocking(False)
                try:
                    sock.connect(self.cfg["socket"])
                    sock.send(_opening(mode))
                except (BlockingIOError, InterruptedError):
                    self.count("control_connect_would_block")  # a full accept queue
                    sock.close()
                    break
                except OSError as exc:
                    self.count(f"control_connect_{type(exc).__name__}")
                    sock.close()
                    break
                opened += 1
                self.count("control_opened")
                selector.register(sock, selectors.EVENT_READ, mode)
            if len(selector.get_map()) >= n or time.monotonic() - started > 5:
                flooding.touch()
            for key, _ in selector.select(0.05):
                sock = key.fileobj
                try:
                    data = sock.recv(1 << 16)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    self.count("control_closed_by_daemon")
                    selector.unregister(sock)
                    sock.close()
                else:
                    self.count("control_replies")  # a refused hello says why, then closes
        with self.lock:
            self.counts["control_open_at_end"] = len(selector.get_map())
        for key in list(selector.get_map().values()):
            key.fileobj.close()

    def bodies(self) -> None:
        """Encoded once, before the flood starts (encoding takes seconds of CPU)."""
        ns = encode_namespace(namespace(self.cfg["tenant"]))
        self.bodies_ = [
            ("bad_ids", json.dumps({"namespace": ns, "token_ids": [1 << 40] * 1_000_000})),
            ("too_many", json.dumps({"namespace": ns, "token_ids": [7] * 3_000_000})),
        ]

    def http_oversized(self, which: int) -> None:
        bodies = self.bodies_
        token = {"Authorization": f"Bearer {self.cfg['token']}", "Content-Type": "application/json"}
        plain = {"Content-Type": "application/json"}
        i = which
        while not self.should_stop():
            i += 1
            name, body = bodies[i % len(bodies)]
            encoded = body.encode()
            headers = token if i % 3 else plain
            label = name if i % 3 else f"{name}_no_token"
            try:
                if i % 5 == 0:
                    status = self._lying_length()
                    label = "claims_1gb"
                else:
                    status = self._post(encoded, headers)
            except OSError as exc:
                status = type(exc).__name__
            self.count(f"http_{label}_{status}")

    def _post(self, body: bytes, headers: dict[str, str]) -> int:
        host, port = self.cfg["http_host"], self.cfg["http_port"]
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        with socket.create_connection((host, port), 20, (OVERSIZED_FROM, 0)) as sock:
            sock.sendall(
                f"POST /v1/lookup HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
                f"{head}Content-Length: {len(body)}\r\n\r\n".encode()
            )
            try:
                sock.sendall(body)
            except OSError:
                pass  # the daemon may answer 413 and close before reading the body
            return _status(sock)

    def _lying_length(self) -> int:
        host, port = self.cfg["http_host"], self.cfg["http_port"]
        with socket.create_connection((host, port), 20, (OVERSIZED_FROM, 0)) as sock:
            sock.sendall(
                f"POST /v1/lookup HTTP/1.1\r\nHost: {host}\r\n"
                f"Content-Length: {1 << 30}\r\nContent-Type: application/json\r\n"
                f'\r\n{{"namespace":'.encode()
            )
            return _status(sock)

    def slowloris(self) -> None:
        host, port, n = self.cfg["http_host"], self.cfg["http_port"], self.cfg["slowloris"]
        socks: list[socket.socket] = []
        while not self.should_stop():
            while len(socks) < n:
                try:
                    sock = socket.create_connection((host, port), 5, (SLOWLORIS_FROM, 0))
                    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never ends
                except OSError as exc:
                    self.count(f"slowloris_connect_{type(exc).__name__}")
                    break
                sock.setblocking(False)
                socks.append(sock)
                self.count("slowloris_opened")
            alive = []
            for sock in socks:
                try:
                    sock.send(b"X")
                    data = sock.recv(4096)
                except BlockingIOError:
                    alive.append(sock)  # nothing to read: still open
                    continue
                except OSError:
                    data = b""
                self.count(
                    "slowloris_closed_by_daemon"
                    if not data or data.startswith(b"HTTP/1.1 408")
                    else "slowloris_other_reply"
                )
                sock.close()
            socks = alive
            self.stopped.wait(0.5)
        for sock in socks:
            sock.close()


def _status(sock: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return 0  # closed without an answer
        data += chunk
    return int(data.split(b" ", 2)[1])


def flood(cfg: dict[str, Any], workdir: Path, events: Events) -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    attack = Flood(cfg, workdir)
    attack.bodies()
    threads = [
        threading.Thread(target=attack.control, name="control"),
        threading.Thread(target=attack.slowloris, name="slowloris"),
        *(
            threading.Thread(target=attack.http_oversized, args=(i,), name=f"http{i}")
            for i in range(cfg["http_threads"])
        ),
    ]
    for thread in threads:
        thread.start()
    last = time.monotonic()
    while not attack.should_stop():
        time.sleep(0.2)
        if time.monotonic() - last > 1:
            last = time.monotonic()
            with attack.lock:
                events.emit("counts", counts=dict(attack.counts))
    for thread in threads:
        thread.join(90)
    events.emit("counts", counts=dict(attack.counts))
