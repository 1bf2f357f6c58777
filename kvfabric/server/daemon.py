"""The node daemon: the tiered store served over the control socket and the HTTP API.

Lifecycle of :func:`run` (``kvfabric serve``):

1. open the store (SSD contents are re-indexed from the segment headers) and join the
   global index (:class:`~kvfabric.server.cluster_link.ClusterLink`: register, publish the
   inventory, heartbeat). With the redis index the node also opens a peer transport with
   its host arenas registered (region id = arena id) and advertises it, with its TCP
   control endpoint, so peers can pull its chunks (:mod:`kvfabric.server.puller`) and push
   chunks to it (:mod:`kvfabric.server.pusher`);
   Before any of it, the bind rule (:func:`kvfabric.config.check_binds`): a listener beyond
   loopback without authentication is refused, or, with ``security.allow_insecure``, logged
   as a WARNING and listed in ``/healthz`` and ``/v1/stats`` (``warnings``);
2. listen on the Unix socket (and TCP if configured) on one event loop (uvloop's where it is
   installed: :func:`event_loop_factory`), then on HTTP on a thread and loop of its own
   (:mod:`kvfabric.api.http_server`: request parsing never runs on the control loop, and
   large lookup bodies are parsed in worker processes: :mod:`kvfabric.api.lookup_workers`). With
   TLS configured (``security.tls_*``) the HTTP and TCP planes serve TLS; the certificate is
   re-read on SIGHUP and when its files change (:mod:`kvfabric.server.tls`). Toward peers the
   same certificate is the client certificate: the peer links speak TLS to peers' TCP control
   endpoints when the ``tcp`` plane does, and the socket transport is mutual TLS when the
   ``peer`` plane is on (``transport: auto`` then picks it over NIXL, which is not encrypted);
3. write the ready file if asked (JSON: pid, socket, tcp_port, http_port, node_id, and the
   KV event endpoints when :mod:`kvfabric.kvevents` publishes) and
   report ready on ``/readyz`` (503 again if the peer transport's accept loop dies);
4. on SIGTERM or SIGINT: report not ready, stop accepting, give in-flight requests a grace
   period, close every session (their leases are given back), stop HTTP, then close the
   store, which waits for queued SSD writes, and the cluster link. A restart finds the SSD
   contents again and republishes them under a new epoch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import ssl
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi import FastAPI

from kvfabric.api.app import create_app
from kvfabric.api.http_server import HttpLimits, HttpServer
from kvfabric.api.metrics import Metrics
from kvfabric.api.transfers import RecentTransfers
from kvfabric.config import DaemonConfig, check_binds
from kvfabric.errors import ConfigError
from kvfabric.kvevents.announce import MEDIUM_OF_KIND, Announcer
from kvfabric.kvevents.intents import Intents
from kvfabric.kvevents.log import ChangeLog
from kvfabric.kvevents.node import NamespaceEvents
from kvfabric.kvevents.publisher import EventStream
from kvfabric.kvevents.remote import RemoteFollower, RemoteInventory
from kvfabric.server.cluster_link import ClusterLink
from kvfabric.server.control import ControlServer
from kvfabric.server.handlers import Context
from kvfabric.server.instrumented import InstrumentedPuller, InstrumentedPusher, InstrumentedStore
from kvfabric.server.peers import PeerLinks
from kvfabric.server.puller import Puller
from kvfabric.server.pusher import Pusher
from kvfabric.server.remote_chunks import IndexRemoteSource
from kvfabric.server.tls import ReloadingTLS
from kvfabric.server.wire_fp8 import STAGING_REGION, Fp8Targets, Fp8Wire, WireStaging
from kvfabric.store import TieredStore
from kvfabric.transport import SocketTransport, Transport, select_backend
from kvfabric.transport.acceptor import AcceptLimits

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0
GIL_SWITCH_INTERVAL_S = 0.0005  # see run()


class Daemon:
    """One node's store, control server and HTTP API."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.node_id = config.node_id
        self.started_at = time.time()
        self._ready = False
        # Refused (ConfigError) before anything listens, or accepted and said loudly.
        self.warnings: tuple[str, ...] = tuple(check_binds(config))
        for warning in self.warnings:
            log.warning("%s (security.allow_insecure is set)", warning)
        self.tls = ReloadingTLS(config.security) if config.security.tls_cert_file else None
        peers = config.cluster.index == "redis"
        if peers and config.tcp.port is None:
            raise ConfigError(
                "cluster.index redis needs the TCP control endpoint (tcp.port; "
                "0 picks a free port): peers pull this node's chunks through it"
            )
        # every token tenant gets arenas of its own (kvfabric/store/tenants.py)
        self._raw_store = TieredStore(config.store, tenants=config.auth.tenants.values())
        self.metrics = Metrics(self._raw_store)
        self.metrics.describe_node(config.node_id, config.cluster.hardware_class)
        self.store = InstrumentedStore(self._raw_store, self.metrics)
        self.transfers = RecentTransfers()  # GET /v1/transfers/recent, the /ui page
        self._tcp: socket.socket | None = None
        self.transport: Transport | None = None
        self._staging: WireStaging | None = None
        try:
            if config.tcp.port is not None:
                self._tcp = _tcp_listener(config.tcp.host, config.tcp.port)
            address = config.cluster.advertise or config.socket_path
            transports: dict[str, str] = {}
            if peers:
                assert self._tcp is not None
                host = _reachable_host(config.tcp.host)
                address = config.cluster.advertise or _host_port(host, self._tcp.getsockname()[1])
                self.transport = _open_transport(config, host, self._raw_store, self.tls)
                # registered before the descriptor is taken: peers learn regions from it
                self._staging = _wire_staging(config, self.transport)
                transports[self.transport.backend] = self.transport.descriptor().hex()
            self.cluster = ClusterLink(
                config.cluster,
                self.node_id,
                address,
                self._raw_store,
                transports,
                publishes_tokens=lambda ns: config.kv_events.publishes(ns.tenant_salt),
            )
        except BaseException:
            self._close_transport_and_listener()
            self._raw_store.close()
            raise
        self.metrics.watch_index(config.cluster.index, lambda: self.cluster.reachable)
        fp8_peers = Fp8Targets.parse(config.cluster.fp8_wire_peers)
        self._links = (
            None
            if self.transport is None
            else PeerLinks(
                self.cluster, self.transport, config.auth.admin_token, self._peer_tls("tcp")
            )
        )
        self.puller = (
            None
            if self._links is None
            else InstrumentedPuller(
                Puller(self.store, self._links, staging=self._staging, fp8_from=fp8_peers),
                self.metrics,
                self.transfers,
            )
        )
        self.pusher = (
            None
            if self._links is None
            else InstrumentedPusher(
                Pusher(
                    self.store,
                    self._links,
                    staging=self._staging,
                    fp8_to=fp8_peers,
                ),
                self.metrics,
                self.transfers,
            )
        )
        self.kv_events, self.event_stream, self._remote_chunks = _kv_events(
            config, self._raw_store, self.cluster
        )
        self._executor = ThreadPoolExecutor(
            config.limits.request_threads, thread_name_prefix="kvfabric-request"
        )
        self.control = ControlServer(
            Context(
                self.store,
                config.auth,
                self.node_id,
                config.limits.max_leases_per_session,
                self.cluster,
                self.puller,
                self.pusher,
                self.kv_events,
                None if self._staging is None else Fp8Wire(self._staging),
            ),
            self._executor,
            self.metrics,
            socket_path=config.socket_path,
            tcp_listener=self._tcp,
            max_sessions=config.limits.max_sessions,
            tcp_ssl=self._tls_for("tcp"),
            limits=config.limits,
            transfers=self.transfers,
        )
        self.http_port: int | None = None
        self._http: HttpServer | None = None
        self._http_app: FastAPI | None = None
        self._stop: asyncio.Event | None = None

    @property
    def session_count(self) -> int:
        return self.control.session_count

    @property
    def ready(self) -> bool:
        """Serving, and every plane that should accept still does."""
        return self._ready and self.not_ready_reason is None

    @property
    def not_ready_reason(self) -> str | None:
        if not self._ready:
            return "starting or draining"
        if self.transport is not None and not getattr(self.transport, "serving", True):
            return f"peer transport not accepting: {getattr(self.transport, 'failure', '')}"
        if self._http is not None and not self._http.alive:
            return "HTTP server stopped"
        return None

    def _tls_for(self, plane: str) -> ssl.SSLContext | None:
        return self.tls.context if self.tls and self.config.security.tls_on(plane) else None

    def _peer_tls(self, plane: str) -> Callable[[], ssl.SSLContext] | None:
        """The client context toward peers' ``plane`` (read per connection: reloads apply)."""
        tls = self.tls
        if tls is None or not self.config.security.tls_on(plane):
            return None
        return lambda: tls.client_context

    def reload_tls(self, *, force: bool = False) -> bool:
        """Re-read the certificate files (SIGHUP: ``force``); True if one was loaded."""
        return self.tls is not None and self.tls.reload_if_changed(force=force)

    def request_stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    async def serve(self, ready_file: Path | None = None) -> None:
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        reload_task = None
        if self.tls is not None:
            loop.add_signal_handler(signal.SIGHUP, lambda: self.reload_tls(force=True))
            reload_task = asyncio.create_task(self._watch_certificates())
        await self.control.start()
        if self.config.http.port is not None:
            listener = _tcp_listener(self.config.http.host, self.config.http.port)
            self.http_port = listener.getsockname()[1]
            limits = self.config.limits
            self._http_app = create_app(
                self,
                max_body_bytes=limits.http_max_body_bytes,
                parse_workers=limits.http_parse_workers,
            )
            self._http = HttpServer(
                self._http_app,
                listener,
                HttpLimits(
                    request_timeout_s=limits.http_request_timeout_s,
                    keepalive_s=limits.http_keepalive_s,
                    max_connections=limits.http_max_connections,
                    max_connections_per_ip=limits.http_max_connections_per_ip,
                    shutdown_grace_s=SHUTDOWN_GRACE_S,
                ),
                ssl_context=self._tls_for("http"),
                loop_factory=event_loop_factory(),
                on_refused=lambda reason: self.metrics.control_connection_closed("http", reason),
            )
            await asyncio.to_thread(self._http.start)
        if ready_file is not None:
            _write_ready_file(ready_file, self)
        self._ready = True
        log.info(
            "kvfabric node %s serving %s (http %s%s)",
            self.node_id,
            self.config.socket_path,
            self.http_port,
            ", TLS" if self.tls else "",
        )
        await self._stop.wait()
        log.info("shutting down")
        self._ready = False
        if reload_task is not None:
            reload_task.cancel()
        await self.control.stop(SHUTDOWN_GRACE_S)
        if self._http is not None:
            await asyncio.to_thread(self._http.stop)
            assert self._http_app is not None
            self._http_app.state.lookup_parsers.close()  # its worker processes end
        await loop.run_in_executor(None, self.close)

    async def _watch_certificates(self) -> None:
        while True:
            await asyncio.sleep(self.config.security.tls_reload_s)
            self.reload_tls()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._remote_chunks is not None:
            self._remote_chunks.close()
        if self.event_stream is not None:
            self.event_stream.close()
        if self.kv_events.intents is not None:
            self.kv_events.intents.close()
        if self._links is not None:
            self._links.close()  # peers give back the pins and reservations taken for us
        # before the store: no peer may read the arenas once they are unmapped
        self._close_transport_and_listener()
        self._raw_store.close()
        # after the store: what closing it moved (persist_on_close) is still published
        self.cluster.close()

    def _close_transport_and_listener(self) -> None:
        if self.transport is not None:
            self.transport.close()
        if self._staging is not None:
            self._staging.close()
        if self._tcp is not None:
            self._tcp.close()  # asyncio closed it already if the server ran; closing twice is fine


def _kv_events(
    config: DaemonConfig, store: TieredStore, cluster: ClusterLink
) -> tuple[NamespaceEvents, EventStream | None, RemoteFollower | None]:
    """The change log engines' connectors poll (the ``kv_events`` op) and, with
    ``kv_events.endpoint``, the node's event stream (:mod:`kvfabric.kvevents.publisher`),
    with ``kv_events.remote`` also the thread that follows the chunks other nodes hold
    (:mod:`kvfabric.kvevents.remote`) from the global index."""
    changes = ChangeLog(config.kv_events.log_changes)
    # in flight: lookups count an object from its reservation on, so routers hear of it
    # then too (a prefix being computed is where its next request should go)
    store.add_inventory_listener(changes.on_inventory, in_flight=True)
    media = {
        name: MEDIUM_OF_KIND[tier.kind]
        for name, tier in zip(store.tier_names, config.store.tiers, strict=True)
    }
    settings = config.kv_events
    if not settings.endpoint:
        return NamespaceEvents(changes, media, store.inventory), None, None
    # engines announce a prompt's chunks when they admit it (the ``intend`` op): routers
    # reading the node's stream hear of them before the first layer is computed
    intents = Intents(changes, store.contains, store.tier_names[0], ttl_s=settings.intent_ttl_s)
    intents.start()
    per_namespace = NamespaceEvents(changes, media, store.inventory, intents)
    remote_on = settings.remote if settings.remote is not None else config.cluster.index == "redis"
    remote = RemoteInventory(config.node_id, settings.block_size, media) if remote_on else None
    stream = EventStream(
        changes,
        Announcer(settings.block_size, media, lambda ns: settings.publishes(ns.tenant_salt)),
        store.inventory,
        settings.endpoint,
        replay_endpoint=settings.replay_endpoint or None,
        topic=settings.topic,
        buffer_batches=settings.buffer_batches,
        remote=remote,
    )
    stream.start()
    follower = None
    if remote is not None:
        follower = RemoteFollower(
            IndexRemoteSource(cluster.index), remote, live_every_s=config.cluster.heartbeat_s
        )
        follower.start()
    log.info(
        "kv_events: vLLM KV events on %s (replay %s), block size %d%s",
        stream.endpoint,
        stream.replay_endpoint,
        settings.block_size,
        ", with other nodes' chunks" if remote is not None else "",
    )
    return per_namespace, stream, follower


def _open_transport(
    config: DaemonConfig, host: str, store: TieredStore, tls: ReloadingTLS | None
) -> Transport:
    """The peer transport (``cluster.transport``) with every host arena registered; with the
    ``peer`` TLS plane, the socket backend over mutual TLS (NIXL is not encrypted: ``auto``
    picks the socket backend then, and config validation refused ``nixl``)."""
    peer_tls = tls is not None and config.security.tls_on("peer")
    preferred = config.cluster.transport
    if peer_tls and preferred == "auto":
        log.info("peer transport: socket (mutual TLS; NIXL is not encrypted)")
        preferred = "socket"
    backend = select_backend(preferred)
    secret = config.cluster.secret()
    if backend is SocketTransport:
        limits = config.limits
        transport: Transport = SocketTransport(
            config.node_id,
            secret=secret,
            host=config.tcp.host,
            advertise_host=host,
            limits=AcceptLimits(
                handshake_timeout_s=limits.peer_handshake_timeout_s,
                max_handshakes=limits.peer_max_handshakes,
                max_per_ip=limits.peer_max_handshakes_per_ip,
                max_connections=limits.peer_max_connections,
            ),
            server_ssl=tls.context if tls is not None and peer_tls else None,
            client_ssl=(lambda: tls.client_context) if tls is not None and peer_tls else None,
        )
    else:
        transport = backend(config.node_id, secret=secret)
    try:
        for index, _, arena in store.host_arenas():
            transport.register(index, arena.array)
    except BaseException:
        transport.close()
        raise
    return transport


def _wire_staging(config: DaemonConfig, transport: Transport) -> WireStaging | None:
    """The fp8 staging arena (``cluster.wire_staging_bytes``; 0: none), registered with the
    transport (:mod:`kvfabric.server.wire_fp8`)."""
    if not config.cluster.wire_staging_bytes:
        return None
    staging = WireStaging(config.cluster.wire_staging_bytes)
    try:
        transport.register(STAGING_REGION, staging.arena.array)
    except BaseException:
        staging.close()
        raise
    return staging


def _reachable_host(host: str) -> str:
    """The host peers reach a listener bound to ``host`` at (a wildcard: this host's name)."""
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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
    info = {
        "pid": os.getpid(),
        "node_id": daemon.node_id,
        "socket": daemon.config.socket_path,
        "tcp_port": daemon.control.tcp_port,
        "http_port": daemon.http_port,
    }
    if daemon.event_stream is not None:  # the bound ports, when the config asked for any
        info["kv_events_endpoint"] = daemon.event_stream.endpoint
        info["kv_events_replay_endpoint"] = daemon.event_stream.replay_endpoint
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)  # readers never see a half-written file


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop's event loop where it is installed (a control round trip costs ~10-15 us less
    than on asyncio's own loop), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def run(config: DaemonConfig, *, ready_file: Path | None = None) -> int:
    """Run the daemon until SIGTERM / SIGINT; returns the process exit code."""
    # The control loop shares the GIL with the HTTP thread and the store's threads; after
    # each syscall it waits for the GIL up to this long while another thread computes (5 ms
    # by default: under a connection flood with HTTP requests the loop accepted ~200
    # connections a second and new sessions waited 1-2 s behind the accept queue).
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    daemon = Daemon(config)
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            runner.run(daemon.serve(ready_file))
    except BaseException:
        daemon.close()
        raise
    return 0
