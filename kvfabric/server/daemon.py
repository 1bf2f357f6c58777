"""The node daemon: the tiered store served over the control socket and the HTTP API.

Lifecycle of :func:`run` (``kvfabric serve``):

1. open the store (SSD contents are re-indexed from the segment headers) and join the
   global index (:class:`~kvfabric.server.cluster_link.ClusterLink`: register, publish the
   inventory, heartbeat);
2. listen on the Unix socket (and TCP if configured), then on HTTP;
3. write the ready file if asked (JSON: pid, socket, tcp_port, http_port, node_id) and
   report ready on ``/readyz``;
4. on SIGTERM or SIGINT: report not ready, stop accepting, give in-flight requests a grace
   period, close every session (their leases are given back), stop HTTP, then close the
   store, which waits for queued SSD writes, and the cluster link. A restart finds the SSD
   contents again and republishes them under a new epoch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import uvicorn

from kvfabric.api.app import create_app
from kvfabric.api.metrics import Metrics
from kvfabric.config import DaemonConfig
from kvfabric.server.cluster_link import ClusterLink
from kvfabric.server.control import ControlServer
from kvfabric.server.handlers import Context
from kvfabric.server.instrumented import InstrumentedStore
from kvfabric.store import TieredStore

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0


class Daemon:
    """One node's store, control server and HTTP API."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.node_id = config.node_id
        self.started_at = time.time()
        self.ready = False
        self._raw_store = TieredStore(config.store)
        self.metrics = Metrics(self._raw_store)
        self.store = InstrumentedStore(self._raw_store, self.metrics)
        try:
            self.cluster = ClusterLink(config.cluster, self.node_id,
                                       config.cluster.advertise or config.socket_path,
                                       self._raw_store)
        except BaseException:
            self._raw_store.close()
            raise
        self._executor = ThreadPoolExecutor(config.limits.request_threads,
                                            thread_name_prefix="kvfabric-request")
        self.control = ControlServer(
            Context(self.store, config.auth, self.node_id, config.limits.max_leases_per_session,
                    self.cluster),
            self._executor, self.metrics, socket_path=config.socket_path,
            tcp_host=config.tcp.host, tcp_port=config.tcp.port,
            max_sessions=config.limits.max_sessions)
        self.http_port: int | None = None
        self._stop: asyncio.Event | None = None

    @property
    def session_count(self) -> int:
        return self.control.session_count

    def request_stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    async def serve(self, ready_file: Path | None = None) -> None:
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        await self.control.start()
        http_task = http = None
        if self.config.http.port is not None:
            listener = _tcp_listener(self.config.http.host, self.config.http.port)
            self.http_port = listener.getsockname()[1]
            http = _EmbeddedUvicorn(uvicorn.Config(create_app(self), log_level="warning",
                                                   access_log=False, lifespan="off"))
            http_task = asyncio.create_task(http.serve(sockets=[listener]))
        if ready_file is not None:
            _write_ready_file(ready_file, self)
        self.ready = True
        log.info("kvfabric node %s serving %s (http %s)", self.node_id, self.config.socket_path,
                 self.http_port)
        await self._stop.wait()
        log.info("shutting down")
        self.ready = False
        await self.control.stop(SHUTDOWN_GRACE_S)
        if http is not None and http_task is not None:
            http.should_exit = True
            await http_task
        await loop.run_in_executor(None, self.close)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._raw_store.close()
        # after the store: what closing it moved (persist_on_close) is still published
        self.cluster.close()


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside the daemon's loop: the daemon, not uvicorn, owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _tcp_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket whose accepted connections get TCP_NODELAY from asyncio.

    asyncio sets TCP_NODELAY only on sockets whose ``proto`` is IPPROTO_TCP, and
    ``socket.create_server`` leaves it 0: responses written in two parts (headers, body)
    would then wait for the client's delayed ACK, ~40 ms per request.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(1024)
    except OSError:
        listener.close()
        raise
    return listener


def _write_ready_file(path: Path, daemon: Daemon) -> None:
    info = {"pid": os.getpid(), "node_id": daemon.node_id, "socket": daemon.config.socket_path,
            "tcp_port": daemon.control.tcp_port, "http_port": daemon.http_port}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)  # readers never see a half-written file


def run(config: DaemonConfig, *, ready_file: Path | None = None) -> int:
    """Run the daemon until SIGTERM / SIGINT; returns the process exit code."""
    daemon = Daemon(config)
    try:
        asyncio.run(daemon.serve(ready_file))
    except BaseException:
        daemon.close()
        raise
    return 0
