"""Daemon configuration: one frozen value, from a YAML file, the environment and flags.

Precedence: command-line ``--set`` flags override ``KVFABRIC_*`` environment variables, which
override the YAML file, which overrides the built-in defaults (:mod:`kvfabric.config_layers`
merges them: dotted keys, ``KVFABRIC_A__B`` variables, YAML scalars, renamed keys).
:func:`load_config` validates the result into :class:`DaemonConfig`, whose sections are
frozen configuration models (:mod:`kvfabric.config_model`): unknown keys are errors, and every
problem raises one :class:`~kvfabric.errors.ConfigError` naming the dotted key
(``limits.max_sessions: must be a positive integer, got 0``). Values are read-only once
built; :func:`check_binds` enforces the bind rule on a built config.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import PlainValidator, model_validator

from kvfabric.config_layers import ENV_PREFIX, layered, tiers_as_list
from kvfabric.config_model import KeyProblems, config_value, parse_config
from kvfabric.config_types import (
    ByteSizeOrZero,
    Flag,
    OptionalFlag,
    OptionalPath,
    OptionalText,
    PositiveInt,
    Seconds,
    SecondsOrZero,
    Text,
    int_in,
    one_of,
)
from kvfabric.errors import ConfigError
from kvfabric.store.config import StoreConfig
from kvfabric.tiers.base import TierKind

__all__ = [
    "ENV_PREFIX",
    "AuthConfig",
    "ClusterConfig",
    "DaemonConfig",
    "Endpoint",
    "Limits",
    "SecurityConfig",
    "build_config",
    "check_binds",
    "exposed_planes",
    "is_loopback",
    "load_config",
]

DEFAULT_HTTP_PORT = 8790
LOOKUP_TOKENS_CEILING = 1 << 22  # kvfabric.protocol.messages.MAX_TOKENS, without importing it
CONTROL_FRAME_CEILING = 8 << 20  # kvfabric.protocol.frames.MAX_FRAME, without importing it


def _host(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError("must be a non-empty string")
    return value


def _port(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 65535:
        return value
    raise ConfigError(f"must be an integer in [0, 65535] or null, got {value!r}")


@config_value
class Endpoint:
    """A TCP listener; ``port`` None disables it, 0 picks a free port."""

    host: Annotated[str, PlainValidator(_host)] = "127.0.0.1"
    port: Annotated[int | None, PlainValidator(_port)] = None


def _tenants(value: object) -> Mapping[str, str]:
    # never echo a key: it is a token
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and k and isinstance(v, str) for k, v in value.items()
    ):
        raise ConfigError("must map token strings to tenant names")
    return dict(value)


@config_value
class AuthConfig:
    """Bearer tokens. ``token`` is the admin token; ``tenants`` maps tokens to the one tenant
    (namespace ``tenant_salt``) they may touch. No tokens at all: authentication is off."""

    token: OptionalText = None
    token_file: OptionalText = None
    tenants: Annotated[Mapping[str, str], PlainValidator(_tenants)] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return bool(self.admin_token or self.tenants)

    @property
    def admin_token(self) -> str | None:
        if self.token:
            return self.token
        if self.token_file:
            try:
                return Path(self.token_file).read_text().strip() or None
            except OSError as exc:
                raise ConfigError(f"auth.token_file: {exc}") from None
        return None


@config_value
class Limits:
    max_sessions: PositiveInt = 1024
    max_leases_per_session: PositiveInt = 4096
    request_threads: PositiveInt = 32  # blocking store calls (SSD reads, layer waits) run here

    # HTTP plane: bounds applied before a body is parsed, and deadlines against slowloris.
    http_max_body_bytes: PositiveInt = 16 << 20  # 413 above this, before reading the body
    # token ids per /v1/lookup (413 above, before validating)
    lookup_max_tokens: Annotated[
        int, PlainValidator(int_in(1, LOOKUP_TOKENS_CEILING, why="the protocol's bound"))
    ] = 1 << 20
    http_request_timeout_s: Seconds = 10.0  # a request's headers and body must arrive within this
    http_keepalive_s: Seconds = 5.0  # an idle keep-alive connection is closed after this
    http_max_connections: PositiveInt = 1024  # beyond this, new requests get 503
    # open HTTP connections of one source address (loopback too): beyond it 503, and the
    # refused connection takes none of the global slots, so one client cannot lock out others
    http_max_connections_per_ip: PositiveInt = 64
    # processes parsing lookup bodies over 32 KiB (0: threads of the daemon, whose GIL the
    # control loop shares: a million-id body then slows control round trips)
    http_parse_workers: Annotated[int, PlainValidator(int_in(0, 64))] = 2
    # Peer transport (socket backend): unauthenticated connections are bounded, never a thread.
    peer_handshake_timeout_s: Seconds = 5.0
    peer_max_handshakes: PositiveInt = 256  # handshakes in progress at once, all addresses
    peer_max_handshakes_per_ip: PositiveInt = 32
    peer_max_connections: PositiveInt = 512  # authenticated peer connections (one thread each)
    # Control socket (Unix and TCP listeners): connections before hello are few and short-lived,
    # no peer (uid on the Unix socket, source address on TCP) can take every session.
    control_hello_timeout_s: Seconds = 5.0  # a connection must complete its hello within this
    # no lease, request or bytes this long: closed (0: never)
    control_idle_timeout_s: SecondsOrZero = 300.0
    # largest frame accepted before hello
    control_hello_max_bytes: Annotated[
        int, PlainValidator(int_in(1024, CONTROL_FRAME_CEILING, why="the protocol's frame bound"))
    ] = 64 << 10
    control_max_pending: PositiveInt = 256  # connections before hello, all peers (oldest first)
    control_max_pending_per_peer: PositiveInt = 64  # the same, per peer (its own oldest first)
    control_max_sessions_per_peer: PositiveInt = 512  # authenticated sessions per peer
    control_listen_backlog: PositiveInt = 1024  # accept queue of each listener (somaxconn caps)


TLS_PLANES = ("http", "tcp", "peer")


def _planes(value: object) -> str:
    if not isinstance(value, str) or not set(_split(value)) <= set(TLS_PLANES):
        raise ConfigError(f"must be a comma-separated subset of {list(TLS_PLANES)}, got {value!r}")
    return value


def _split(planes: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in planes.split(",") if p.strip())


@config_value
class SecurityConfig:
    """Bind rules and TLS (see the README's Security section).

    A listener bound beyond loopback (HTTP, TCP control, the peer transport) needs
    authentication: tokens (``auth``) for HTTP and TCP control, the cluster secret for the
    peer transport. Without it the daemon refuses to start, unless ``allow_insecure`` says
    otherwise; then every exposed plane is logged as a WARNING at start and listed under
    ``warnings`` in ``/healthz`` and ``/v1/stats``.

    ``tls_cert_file`` (PEM chain; the key in ``tls_key_file`` or in the same file) turns TLS
    on for the planes in ``tls_planes`` (comma-separated: ``http``, ``tcp``, ``peer``: the
    socket peer transport); plain connections to them fail. ``tls_client_ca_file`` also
    requires client certificates signed by that CA (mutual TLS). The files are re-read on
    SIGHUP and when their mtime changes (checked every ``tls_reload_s``); new connections get
    the new certificate.

    Between nodes (``cluster.index: redis``) the same certificate is the node's identity both
    ways: it serves, and it is presented as the client certificate when this node connects to
    a peer's TCP control endpoint or transport; peers' certificates are checked against
    ``tls_client_ca_file`` (else the system's trust store) and the host they advertise. The
    ``peer`` plane is always mutual, so it needs ``tls_client_ca_file``, and the NIXL
    transport (UCX) is not encrypted: with ``peer`` on, ``transport: auto`` picks the socket
    backend and ``transport: nixl`` is refused. Every node of a cluster needs the same planes.
    """

    allow_insecure: Flag = False
    tls_cert_file: OptionalPath = None
    tls_key_file: OptionalPath = None
    tls_client_ca_file: OptionalPath = None
    tls_planes: Annotated[str, PlainValidator(_planes)] = "http,tcp,peer"
    tls_reload_s: Seconds = 10.0

    @model_validator(mode="after")
    def _needs_cert(self) -> SecurityConfig:
        if self.tls_cert_file is None:
            for name in ("tls_key_file", "tls_client_ca_file"):
                if getattr(self, name):
                    raise KeyProblems([(name, "needs security.tls_cert_file")])
        return self

    @property
    def planes(self) -> tuple[str, ...]:
        return _split(self.tls_planes)

    def tls_on(self, plane: str) -> bool:
        """Whether ``plane`` ("http" or "tcp") serves TLS."""
        return self.tls_cert_file is not None and plane in self.planes


INDEX_BACKENDS = ("embedded", "redis")
# redis://host:port/0 one server; redis+cluster://host:port/0 a Redis Cluster (any node).
REDIS_SCHEMES = ("redis", "redis+cluster")
TRANSPORTS = ("auto", "socket", "nixl")  # kvfabric.transport.BACKENDS, without importing it


@config_value
class KVEventsConfig:
    """The node's inventory as vLLM KV events (:mod:`kvfabric.kvevents`).

    ``endpoint`` (``tcp://host:port`` or ``ipc://path``; empty: off) is a ZMQ PUB socket that
    publishes every announceable object of the node as vLLM's ``BlockStored`` /
    ``BlockRemoved`` for engine blocks of ``block_size`` tokens, for routers that consume
    vLLM KV events (``vllm-router --kv-event-source``); ``replay_endpoint`` answers vLLM's
    replay requests, with a snapshot of the inventory for a subscriber that starts late;
    ``topic`` is the frames' first part. The events carry prompts' token ids, so they name
    only namespaces without a tenant salt, plus those of the tenants listed in ``tenants``
    (comma-separated; ``*``: every tenant), and a non-loopback endpoint is an exposed plane
    (the bind rule, ``security.allow_insecure``). ``log_changes`` bounds the change log that
    the stream and the engines' connectors (the ``kv_events`` op) read from.

    ``remote`` (null: on with the redis index, off with the embedded one): the stream also
    announces the chunks other live nodes of the cluster hold, which this node can pull
    (:mod:`kvfabric.kvevents.remote`): ``BlockStored`` with ``ownership`` =
    ``kvfabric:<owner node id>`` and ``locality`` ``REMOTE`` (a router credits them as
    external, e.g. vllm-router at ``--kv-penalty-external``), and ``BlockRemoved`` with the
    same ownership when the owner drops them or its lease lapses. Only chunks whose owner
    published their token ids are announced: a node publishes those of the namespaces its own
    ``tenants`` names, so give every node of a cluster the same ``tenants``.

    ``intent_ttl_s``: an engine's connector announces the chunks of a prompt its engine
    admitted (the ``intend`` op) before it computes them; such an announcement is withdrawn
    after this long unless the chunk was written meanwhile (:mod:`kvfabric.kvevents.intents`).
    """

    endpoint: Text = ""
    replay_endpoint: Text = ""
    block_size: PositiveInt = 16
    topic: Text = ""
    tenants: Text = ""
    buffer_batches: PositiveInt = 10_000
    log_changes: PositiveInt = 65_536
    remote: OptionalFlag = None
    intent_ttl_s: Seconds = 30.0

    @model_validator(mode="after")
    def _endpoints(self) -> KVEventsConfig:
        problems = [
            (name, "must be tcp://host:port or ipc://path")
            for name in ("endpoint", "replay_endpoint")
            if getattr(self, name) and not getattr(self, name).startswith(("tcp://", "ipc://"))
        ]
        if self.replay_endpoint and not self.endpoint:
            problems.append(("replay_endpoint", "needs endpoint"))
        if problems:
            raise KeyProblems(problems)
        return self

    @property
    def tenant_names(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.tenants.split(",") if t.strip())

    def publishes(self, tenant_salt: str) -> bool:
        """Whether the stream names a namespace of this tenant salt."""
        names = self.tenant_names
        return not tenant_salt or "*" in names or tenant_salt in names


@config_value
class ClusterConfig:
    """Membership of the global prefix index (see :mod:`kvfabric.cluster.index`).

    ``index`` "embedded" keeps the index in the daemon's process (one node: the cluster view
    is the local one); "redis" shares ``redis_url`` with every node and router
    (``redis://host:port/0`` one server, ``redis+cluster://host:port/0`` a Redis Cluster
    reached through any of its nodes). The node renews its lease every ``heartbeat_s``;
    readers ignore its entries ``lease_ttl_s`` after the last renewal. ``advertise`` is the
    address peers and routers reach this node at (empty: the control socket path; with the
    redis index, the TCP control endpoint's ``host:port``, where peers pull chunks from);
    ``hardware_class`` groups nodes for routing.
    ``transport`` is the peer transport pulled chunks travel on ("auto": NIXL when it works
    here, else the socket backend); every node of a cluster must end up on the same one.
    ``secret_file`` holds the cluster secret: with it, transport descriptors are HMAC-signed
    and the socket transport's handshake is a challenge-response, so only nodes holding the
    same secret can move chunks between each other.
    ``fp8_wire_peers`` names the peers (node ids or hardware classes, comma-separated; ``*``
    every peer) whose links carry bf16 / fp16 / fp32 chunks as fp8 (e4m3 with per-(layer,
    k|v, head) scales: half the bytes, within the error bound of :mod:`kvfabric.convert.fp8`;
    they land in the namespace's dtype): this node's pushes to them and pulls from them; a
    push may also ask for it. ``wire_staging_bytes`` is the registered memory chunks are
    encoded and decoded through, sending and receiving, a whole transfer's chunks at a time
    (0: this node neither sends nor takes fp8; a chunk that finds no room goes native).
    """

    index: Annotated[Literal["embedded", "redis"], PlainValidator(one_of(*INDEX_BACKENDS))] = (
        "embedded"
    )
    redis_url: OptionalText = None  # never echoed: it may carry a password
    lease_ttl_s: Seconds = 10.0
    heartbeat_s: Seconds = 2.0
    hardware_class: Text = "generic"
    advertise: Text = ""
    transport: Annotated[Literal["auto", "socket", "nixl"], PlainValidator(one_of(*TRANSPORTS))] = (
        "auto"
    )
    secret_file: OptionalText = None
    fp8_wire_peers: Text = ""
    wire_staging_bytes: ByteSizeOrZero = 64 << 20

    def secret(self) -> bytes | None:
        """The cluster secret's bytes (None: no secret configured)."""
        if self.secret_file is None:
            return None
        try:
            secret = Path(self.secret_file).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"cluster.secret_file: {exc}") from None
        if len(secret) < 16:
            raise ConfigError("cluster.secret_file: must hold at least 16 bytes of secret")
        return secret

    @model_validator(mode="after")
    def _consistent(self) -> ClusterConfig:
        problems: list[tuple[str, str]] = []
        if self.index == "redis":
            if not self.redis_url or urlsplit(self.redis_url).scheme not in REDIS_SCHEMES:
                problems.append(
                    (
                        "redis_url",
                        (
                            "must be a redis:// URL (redis+cluster:// for a Redis Cluster) "
                            "when cluster.index is redis"
                        ),
                    )
                )
            else:
                try:
                    _ = urlsplit(self.redis_url).port  # parsing it raises on a malformed port
                except ValueError:
                    problems.append(("redis_url", "has an invalid port"))
        if self.heartbeat_s >= self.lease_ttl_s:
            problems.append(
                (
                    "heartbeat_s",
                    (
                        "must be shorter than cluster.lease_ttl_s, "
                        "or the node's lease lapses between renewals"
                    ),
                )
            )
        if problems:
            raise KeyProblems(problems)
        return self

    @property
    def redis_url_redacted(self) -> str:
        """``redis_url`` without its credentials, for logs."""
        if not self.redis_url:
            return ""
        parts = urlsplit(self.redis_url)
        host = parts.netloc.rpartition("@")[2]
        return parts._replace(netloc=host).geturl()


LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")  # kvfabric.logfmt.FORMATS


@config_value
class DaemonConfig:
    node_id: Text = field(default_factory=socket.gethostname)
    socket_path: Text = ""  # default: <data_dir>/kvfabric.sock
    tcp: Endpoint = field(default_factory=Endpoint)  # remote tooling: lookup / stats only
    http: Endpoint = field(default_factory=lambda: Endpoint(port=DEFAULT_HTTP_PORT))
    auth: AuthConfig = field(default_factory=AuthConfig)
    limits: Limits = field(default_factory=Limits)
    store: StoreConfig = field(default_factory=StoreConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    log_level: Text = "info"
    log_format: Text = "text"  # json: one object per line (kvfabric.logfmt)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)

    @model_validator(mode="after")
    def _consistent(self) -> DaemonConfig:
        if not self.socket_path:
            object.__setattr__(
                self, "socket_path", str(Path(self.store.data_dir) / "kvfabric.sock")
            )
        problems: list[tuple[str, str]] = []
        if any(t.kind is TierKind.DEVICE for t in self.store.tiers):
            problems.append(
                (
                    "store.tiers",
                    (
                        "the daemon serves host tiers to local clients through shared "
                        "memory; a device tier needs CUDA IPC export, not supported yet"
                    ),
                )
            )
        if self.log_level.lower() not in LOG_LEVELS:
            problems.append(("log_level", "must be debug, info, warning or error"))
        if self.log_format not in LOG_FORMATS:
            problems.append(("log_format", "must be text or json"))
        if self.security.tls_on("peer") and self.cluster.index == "redis":
            # a node's certificate is its identity toward peers: both sides must check one
            if self.security.tls_client_ca_file is None:
                problems.append(
                    (
                        "security.tls_client_ca_file",
                        (
                            "security.tls_planes includes peer (the default) with "
                            "cluster.index redis: TLS between nodes is mutual and needs "
                            "security.tls_client_ca_file (the CA of every node's "
                            "certificate); or leave peer out of security.tls_planes"
                        ),
                    )
                )
            if self.cluster.transport == "nixl":
                problems.append(
                    (
                        "cluster.transport",
                        (
                            "nixl is not encrypted (UCX): leave peer "
                            "out of security.tls_planes, or use transport socket (or "
                            "auto, which picks socket when peer TLS is on)"
                        ),
                    )
                )
        if problems:
            raise KeyProblems(problems)
        return self


def is_loopback(host: str) -> bool:
    """Whether a listener bound to ``host`` is reachable from this host only. A wildcard
    (``0.0.0.0``, ``::``, empty) is not; a name counts as loopback only if every address it
    resolves to is (one that does not resolve is not)."""
    if host in ("", "0.0.0.0", "::"):
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return bool(infos) and all(
        ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos
    )


def exposed_planes(config: DaemonConfig) -> list[str]:
    """Planes bound beyond loopback without the authentication that protects them: one line
    each, saying what an outsider could do. Empty: nothing is exposed."""
    out = []
    # configured, not read: an unreadable token file fails the start on its own
    auth = bool(config.auth.token or config.auth.token_file or config.auth.tenants)
    if config.http.port is not None and not is_loopback(config.http.host) and not auth:
        out.append(
            f"HTTP on {config.http.host}:{config.http.port} without auth tokens: "
            "anyone who reaches it has admin rights (stats, evict, metrics)"
        )
    if config.tcp.port is not None and not is_loopback(config.tcp.host):
        if not auth:
            out.append(
                f"TCP control on {config.tcp.host}:{config.tcp.port} without auth "
                "tokens: remote clients get admin sessions"
            )
        if config.cluster.index == "redis" and config.cluster.secret_file is None:
            out.append(
                f"peer transport on {config.tcp.host} without cluster.secret_file: "
                "anyone who reaches it reads and writes the arenas"
            )
    for name in ("endpoint", "replay_endpoint"):
        endpoint = getattr(config.kv_events, name)
        host = urlsplit(endpoint).hostname if endpoint.startswith("tcp://") else None
        if host is not None and not is_loopback(host):
            out.append(
                f"KV events on {endpoint} (kv_events.{name}): anyone who reaches it reads "
                "the token ids of every namespace the stream names (ZMQ has no tokens)"
            )
    return out


def check_binds(config: DaemonConfig) -> list[str]:
    """Enforce the bind rule: ConfigError naming every exposed plane, unless
    ``security.allow_insecure``; then the same lines are returned, to be logged loudly."""
    exposed = exposed_planes(config)
    if exposed and not config.security.allow_insecure:
        raise ConfigError(
            "refusing to listen beyond loopback without authentication: "
            + "; ".join(exposed)
            + ". Configure auth.token_file / auth.tenants "
            "(and cluster.secret_file for peers), bind 127.0.0.1, or set "
            "security.allow_insecure: true (--insecure) to accept the risk"
        )
    return [f"INSECURE: {line}" for line in exposed]


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Sequence[str] = (),
) -> DaemonConfig:
    """File, then environment, then ``key=value`` overrides; validated."""
    return build_config(layered(path, os.environ if env is None else env, overrides))


def build_config(data: Mapping[str, Any]) -> DaemonConfig:
    """A plain mapping (one config file's content) validated into a DaemonConfig."""
    data = dict(data)
    http = data.get("http")
    if isinstance(http, dict) and "port" not in http:
        # http: {host: ...} alone keeps the default port (the Endpoint default, None, would
        # turn HTTP off)
        data["http"] = {**http, "port": DEFAULT_HTTP_PORT}
    if isinstance(data.get("store"), dict):
        data["store"] = tiers_as_list(data["store"])
    return parse_config(DaemonConfig, data)
