"""Daemon configuration: one frozen value, from a YAML file, the environment and flags.

Precedence: command-line ``--set`` flags override ``KVFABRIC_*`` environment variables, which
override the YAML file, which overrides the built-in defaults. Every setting has a dotted path
(``http.port``, ``store.data_dir``, ``store.tiers.dram.capacity`` — tiers are addressed by
name); its environment variable is ``KVFABRIC_`` + the path upper-cased with ``.`` -> ``__``
(``KVFABRIC_STORE__TIERS__DRAM__CAPACITY=4GiB``). Values from the environment and flags are
parsed as YAML scalars (``8080`` is an int, ``true`` a bool). Unknown keys are errors.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml

from kvfabric.errors import ConfigError
from kvfabric.store.config import StoreConfig, default_tiers
from kvfabric.tiers.base import TierKind

ENV_PREFIX = "KVFABRIC_"
# Client-side variables that share the prefix (the CLI's token, the entry script's python):
# never settings of the daemon, so a shell that exports them can still serve.
CLIENT_ONLY_ENV = frozenset({"KVFABRIC_TOKEN", "KVFABRIC_PYTHON"})
DEFAULT_HTTP_PORT = 8790
LOOKUP_TOKENS_CEILING = 1 << 22  # kvfabric.protocol.messages.MAX_TOKENS, without importing it
CONTROL_FRAME_CEILING = 8 << 20  # kvfabric.protocol.frames.MAX_FRAME, without importing it


@dataclass(frozen=True)
class Endpoint:
    """A TCP listener; ``port`` None disables it, 0 picks a free port."""

    host: str = "127.0.0.1"
    port: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError("host must be a non-empty string")
        if self.port is not None and (
            isinstance(self.port, bool)
            or not isinstance(self.port, int)
            or not 0 <= self.port <= 65535
        ):
            raise ConfigError(f"port must be an integer in [0, 65535] or null, got {self.port!r}")


@dataclass(frozen=True)
class AuthConfig:
    """Bearer tokens. ``token`` is the admin token; ``tenants`` maps tokens to the one tenant
    (namespace ``tenant_salt``) they may touch. No tokens at all: authentication is off."""

    token: str | None = None
    token_file: str | None = None
    tenants: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("token", "token_file"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ConfigError(f"auth.{name} must be a string")
        if not isinstance(self.tenants, Mapping) or not all(
            isinstance(k, str) and k and isinstance(v, str) for k, v in self.tenants.items()
        ):
            raise ConfigError("auth.tenants must map token strings to tenant names")

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


@dataclass(frozen=True)
class Limits:
    max_sessions: int = 1024
    max_leases_per_session: int = 4096
    request_threads: int = 32  # blocking store calls (SSD reads, layer waits) run here

    # HTTP plane: bounds applied before a body is parsed, and deadlines against slowloris.
    http_max_body_bytes: int = 16 << 20  # 413 above this, before reading the body
    lookup_max_tokens: int = 1 << 20  # token ids per /v1/lookup (413 above, before validating)
    http_request_timeout_s: float = 10.0  # a request's headers and body must arrive within this
    http_keepalive_s: float = 5.0  # an idle keep-alive connection is closed after this
    http_max_connections: int = 1024  # beyond this, new requests get 503
    # open HTTP connections of one source address (loopback too): beyond it 503, and the
    # refused connection takes none of the global slots, so one client cannot lock out others
    http_max_connections_per_ip: int = 64
    # processes parsing lookup bodies over 32 KiB (0: threads of the daemon, whose GIL the
    # control loop shares: a million-id body then slows control round trips)
    http_parse_workers: int = 2
    # Peer transport (socket backend): unauthenticated connections are bounded, never a thread.
    peer_handshake_timeout_s: float = 5.0
    peer_max_handshakes: int = 256  # handshakes in progress at once, all addresses
    peer_max_handshakes_per_ip: int = 32
    peer_max_connections: int = 512  # authenticated peer connections (one thread each)
    # Control socket (Unix and TCP listeners): connections before hello are few and short-lived,
    # no peer (uid on the Unix socket, source address on TCP) can take every session.
    control_hello_timeout_s: float = 5.0  # a connection must complete its hello within this
    control_idle_timeout_s: float = 300.0  # no lease, request or bytes this long: closed (0: never)
    control_hello_max_bytes: int = 64 << 10  # largest frame accepted before hello
    control_max_pending: int = 256  # connections before hello, all peers (the oldest goes first)
    control_max_pending_per_peer: int = 64  # the same, per peer (its own oldest goes first)
    control_max_sessions_per_peer: int = 512  # authenticated sessions per peer
    control_listen_backlog: int = 1024  # accept queue of each listener (capped by somaxconn)

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_leases_per_session", "request_threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"limits.{name} must be a positive integer")
        for name in (
            "http_max_body_bytes",
            "lookup_max_tokens",
            "http_max_connections",
            "http_max_connections_per_ip",
            "peer_max_handshakes",
            "peer_max_handshakes_per_ip",
            "peer_max_connections",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"limits.{name} must be a positive integer")
        for name in ("http_request_timeout_s", "http_keepalive_s", "peer_handshake_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"limits.{name} must be a positive number of seconds")
        if (
            isinstance(self.http_parse_workers, bool)
            or not isinstance(self.http_parse_workers, int)
            or not 0 <= self.http_parse_workers <= 64
        ):
            raise ConfigError("limits.http_parse_workers must be an integer in [0, 64]")
        if self.lookup_max_tokens > LOOKUP_TOKENS_CEILING:
            raise ConfigError(
                f"limits.lookup_max_tokens must be at most "
                f"{LOOKUP_TOKENS_CEILING} (the protocol's bound)"
            )
        self._check_control()

    def _check_control(self) -> None:
        for name in (
            "control_hello_max_bytes",
            "control_max_pending",
            "control_max_pending_per_peer",
            "control_max_sessions_per_peer",
            "control_listen_backlog",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"limits.{name} must be a positive integer")
        for name, low in (("control_hello_timeout_s", False), ("control_idle_timeout_s", True)):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or value < 0
                or (value == 0 and not low)
            ):
                raise ConfigError(
                    f"limits.{name} must be a "
                    f"{'non-negative' if low else 'positive'} number of seconds"
                )
        if not 1024 <= self.control_hello_max_bytes <= CONTROL_FRAME_CEILING:
            raise ConfigError(
                f"limits.control_hello_max_bytes must be in [1024, "
                f"{CONTROL_FRAME_CEILING}] (the protocol's frame bound)"
            )


TLS_PLANES = ("http", "tcp", "peer")


@dataclass(frozen=True)
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

    allow_insecure: bool = False
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    tls_planes: str = "http,tcp,peer"
    tls_reload_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.allow_insecure, bool):
            raise ConfigError("security.allow_insecure must be true or false")
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"security.{name} must be a path string")
        if self.tls_cert_file is None and (self.tls_key_file or self.tls_client_ca_file):
            raise ConfigError(
                "security.tls_key_file / tls_client_ca_file need security.tls_cert_file"
            )
        if not isinstance(self.tls_planes, str) or not set(self.planes) <= set(TLS_PLANES):
            raise ConfigError(
                f"security.tls_planes must be a comma-separated subset of "
                f"{list(TLS_PLANES)}, got {self.tls_planes!r}"
            )
        if (
            isinstance(self.tls_reload_s, bool)
            or not isinstance(self.tls_reload_s, (int, float))
            or self.tls_reload_s <= 0
        ):
            raise ConfigError("security.tls_reload_s must be a positive number of seconds")

    @property
    def planes(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in str(self.tls_planes).split(",") if p.strip())

    def tls_on(self, plane: str) -> bool:
        """Whether ``plane`` ("http" or "tcp") serves TLS."""
        return self.tls_cert_file is not None and plane in self.planes


INDEX_BACKENDS = ("embedded", "redis")
# redis://host:port/0 one server; redis+cluster://host:port/0 a Redis Cluster (any node).
REDIS_SCHEMES = ("redis", "redis+cluster")
TRANSPORTS = ("auto", "socket", "nixl")  # kvfabric.transport.BACKENDS, without importing it


@dataclass(frozen=True)
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
    """

    index: Literal["embedded", "redis"] = "embedded"
    redis_url: str | None = None
    lease_ttl_s: float = 10.0
    heartbeat_s: float = 2.0
    hardware_class: str = "generic"
    advertise: str = ""
    transport: Literal["auto", "socket", "nixl"] = "auto"
    secret_file: str | None = None

    def secret(self) -> bytes | None:
        """The cluster secret's bytes (None: no secret configured)."""
        if self.secret_file is None:
            return None
        try:
            secret = Path(self.secret_file).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"cluster.secret_file: {exc}") from None
        if len(secret) < 16:
            raise ConfigError("cluster.secret_file must hold at least 16 bytes of secret")
        return secret

    def __post_init__(self) -> None:
        if self.secret_file is not None and not isinstance(self.secret_file, str):
            raise ConfigError("cluster.secret_file must be a path string")
        if self.index not in INDEX_BACKENDS:
            raise ConfigError(
                f"cluster.index must be one of {list(INDEX_BACKENDS)}, got {self.index!r}"
            )
        if self.redis_url is not None and not isinstance(self.redis_url, str):
            raise ConfigError("cluster.redis_url must be a string")
        if self.index == "redis":
            if not self.redis_url or urlsplit(self.redis_url).scheme not in REDIS_SCHEMES:
                # never echo the value: it may carry a password
                raise ConfigError(
                    "cluster.redis_url must be a redis:// URL (redis+cluster:// "
                    "for a Redis Cluster) when cluster.index is redis"
                )
            try:
                _ = urlsplit(self.redis_url).port  # parsing it raises on a malformed port
            except ValueError:
                raise ConfigError("cluster.redis_url has an invalid port") from None
        for name in ("lease_ttl_s", "heartbeat_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"cluster.{name} must be a positive number")
        if self.heartbeat_s >= self.lease_ttl_s:
            raise ConfigError(
                "cluster.heartbeat_s must be shorter than cluster.lease_ttl_s, "
                "or the node's lease lapses between renewals"
            )
        for name in ("hardware_class", "advertise"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"cluster.{name} must be a string")
        if self.transport not in TRANSPORTS:
            raise ConfigError(
                f"cluster.transport must be one of {list(TRANSPORTS)}, got {self.transport!r}"
            )

    @property
    def redis_url_redacted(self) -> str:
        """``redis_url`` without its credentials, for logs."""
        if not self.redis_url:
            return ""
        parts = urlsplit(self.redis_url)
        host = parts.netloc.rpartition("@")[2]
        return parts._replace(netloc=host).geturl()


@dataclass(frozen=True)
class DaemonConfig:
    node_id: str = field(default_factory=socket.gethostname)
    socket_path: str = ""  # default: <data_dir>/kvfabric.sock
    tcp: Endpoint = field(default_factory=Endpoint)  # remote tooling: lookup / stats only
    http: Endpoint = field(default_factory=lambda: Endpoint(port=DEFAULT_HTTP_PORT))
    auth: AuthConfig = field(default_factory=AuthConfig)
    limits: Limits = field(default_factory=Limits)
    store: StoreConfig = field(default_factory=StoreConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    log_level: str = "info"
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        if any(t.kind is TierKind.DEVICE for t in self.store.tiers):
            raise ConfigError(
                "the daemon serves host tiers to local clients through shared "
                "memory; a device tier needs CUDA IPC export, not supported yet"
            )
        if not self.socket_path:
            object.__setattr__(
                self, "socket_path", str(Path(self.store.data_dir) / "kvfabric.sock")
            )
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError("log_level must be debug, info, warning or error")
        if self.security.tls_on("peer") and self.cluster.index == "redis":
            # a node's certificate is its identity toward peers: both sides must check one
            if self.security.tls_client_ca_file is None:
                raise ConfigError(
                    "security.tls_planes includes peer (the default) with "
                    "cluster.index redis: TLS between nodes is mutual and needs "
                    "security.tls_client_ca_file (the CA of every node's "
                    "certificate); or leave peer out of security.tls_planes"
                )
            if self.cluster.transport == "nixl":
                raise ConfigError(
                    "cluster.transport nixl is not encrypted (UCX): leave peer "
                    "out of security.tls_planes, or use transport socket (or "
                    "auto, which picks socket when peer TLS is on)"
                )


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


_SECTIONS: dict[str, type] = {
    "tcp": Endpoint,
    "http": Endpoint,
    "auth": AuthConfig,
    "limits": Limits,
    "cluster": ClusterConfig,
    "security": SecurityConfig,
}


def load_config(
    path: str | os.PathLike | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Sequence[str] = (),
) -> DaemonConfig:
    """File, then environment, then ``key=value`` overrides; validated."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config {str(path)!r}: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config {str(path)!r} must be a mapping at the top level")
        data = loaded or {}
    environ = os.environ if env is None else env
    for name, value in sorted(environ.items()):
        if name.startswith(ENV_PREFIX) and name != ENV_PREFIX and name not in CLIENT_ONLY_ENV:
            dotted = name[len(ENV_PREFIX) :].lower().replace("__", ".")
            _set_path(data, dotted, _scalar(value), source=f"environment {name}")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        dotted, value = item.split("=", 1)
        _set_path(data, dotted.strip(), _scalar(value), source=f"--set {dotted.strip()}")
    return build_config(data)


# Settings holding a path where a leading ``~`` means the daemon user's home, as in a shell
# (configs/dev.yaml keeps everything under ~/.local/share/kvfabric).
HOME_PATHS = (
    ("socket_path",),
    ("store", "data_dir"),
    ("auth", "token_file"),
    ("cluster", "secret_file"),
    ("security", "tls_cert_file"),
    ("security", "tls_key_file"),
    ("security", "tls_client_ca_file"),
)


def _expand_home(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with ``~`` expanded in the :data:`HOME_PATHS` settings (copied, not changed)."""
    out = dict(data)
    for path in HOME_PATHS:
        node: Any = out
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                break
            node[part] = node = dict(node[part])
        else:
            value = node.get(path[-1])
            if isinstance(value, str) and value.startswith("~"):
                node[path[-1]] = os.path.expanduser(value)
    return out


def build_config(data: Mapping[str, Any]) -> DaemonConfig:
    data = _expand_home(dict(data))
    known = {"node_id", "socket_path", "log_level", "store", *_SECTIONS}
    unknown = set(data) - known
    if unknown:
        raise ConfigError(f"unknown config key(s) {sorted(unknown)}; allowed: {sorted(known)}")
    kwargs: dict[str, Any] = {}
    for name in ("node_id", "socket_path", "log_level"):
        if name in data:
            if not isinstance(data[name], str):
                raise ConfigError(f"{name} must be a string")
            kwargs[name] = data[name]
    for name, cls in _SECTIONS.items():
        if name in data:
            value = data[name]
            if name == "http" and isinstance(value, dict) and "port" not in value:
                # http: {host: ...} alone keeps the default port (the Endpoint default,
                # None, would turn HTTP off)
                value = {**value, "port": DEFAULT_HTTP_PORT}
            kwargs[name] = _section(name, cls, value)
    if "store" in data:
        if not isinstance(data["store"], dict):
            raise ConfigError("store must be a mapping")
        kwargs["store"] = StoreConfig.from_dict(_tiers_as_list(data["store"]))
    return DaemonConfig(**kwargs)


def _section(name: str, cls: type, value: Any) -> Any:
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a mapping")
    allowed = set(cls.__dataclass_fields__)
    unknown = set(value) - allowed
    if unknown:
        raise ConfigError(f"{name}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    try:
        return cls(**value)
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _tiers_as_list(store: dict[str, Any]) -> dict[str, Any]:
    """Tiers may be written as a list or (as env / flags produce) a name -> mapping."""
    store = dict(store)
    tiers = store.get("tiers")
    if isinstance(tiers, dict):
        for name, tier in tiers.items():
            if not isinstance(tier, dict):
                raise ConfigError(f"store.tiers.{name} must be a mapping of tier settings")
        store["tiers"] = [dict(t, name=name) for name, t in tiers.items()]
    return store


def _set_path(data: dict[str, Any], dotted: str, value: Any, *, source: str) -> None:
    parts = [p for p in dotted.split(".") if p]
    if not parts:
        raise ConfigError(f"{source}: empty setting name")
    if parts[:2] == ["store", "tiers"]:
        if len(parts) != 4:
            raise ConfigError(f"{source}: tier settings are store.tiers.<name>.<key>")
        tiers = _tier_map(data.setdefault("store", {}))
        tiers.setdefault(parts[2], {"kind": parts[2]})[parts[3]] = value
        return
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{source}: {'.'.join(parts[: i + 1])} is not a section")
    node[parts[-1]] = value


def _tier_map(store: dict[str, Any]) -> dict[str, Any]:
    """The store's tiers as name -> mapping (converted in place; defaults if absent)."""
    tiers = store.get("tiers")
    if tiers is None:
        tiers = [
            {"kind": t.kind.value, "capacity": t.capacity, "name": t.name} for t in default_tiers()
        ]
    if isinstance(tiers, list):
        mapping: dict[str, Any] = {}
        for entry in tiers:
            if not isinstance(entry, dict):
                raise ConfigError("store.tiers entries must be mappings")
            tier = dict(entry)
            mapping[str(tier.pop("name", tier.get("kind")))] = tier
        tiers = mapping
    if not isinstance(tiers, dict):
        raise ConfigError("store.tiers must be a list of tier mappings")
    store["tiers"] = tiers
    return tiers


def _scalar(text: str) -> Any:
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, (str, int, float, bool, dict)) or value is None else text
