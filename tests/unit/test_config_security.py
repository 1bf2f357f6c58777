"""Security settings (kvfabric.config): the bind rule, TLS settings, HTTP and peer-plane
limits; validation and defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfabric.config import (
    DEFAULT_HTTP_PORT,
    LOOKUP_TOKENS_CEILING,
    check_binds,
    exposed_planes,
    is_loopback,
    load_config,
)
from kvfabric.errors import ConfigError
from kvfabric.protocol.messages import MAX_TOKENS

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.1.2.3", False),
        ("no-such-host.invalid", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_defaults_expose_nothing() -> None:
    config = load_config(env={})
    assert exposed_planes(config) == [] and check_binds(config) == []
    assert not config.security.allow_insecure and config.security.tls_cert_file is None


@pytest.mark.parametrize(
    "settings, exposed",
    [
        (["http.host=0.0.0.0"], ["HTTP"]),
        (["tcp.host=0.0.0.0", "tcp.port=9000"], ["TCP control"]),
        (
            [
                "http.host=0.0.0.0",
                "tcp.host=0.0.0.0",
                "tcp.port=9000",
                "cluster.index=redis",
                "cluster.redis_url=redis://r:6379/0",
            ],
            ["HTTP", "TCP control", "peer transport"],
        ),
        (
            [
                "http.host=0.0.0.0",
                "tcp.host=0.0.0.0",
                "tcp.port=9000",
                "cluster.index=redis",
                "cluster.redis_url=redis://r:6379/0",
                "auth.token=t",
            ],
            ["peer transport"],
        ),
        (
            [
                "http.host=0.0.0.0",
                "tcp.host=0.0.0.0",
                "tcp.port=9000",
                "cluster.index=redis",
                "cluster.redis_url=redis://r:6379/0",
                "auth.tenants={t: a}",
                "cluster.secret_file=/s",
            ],
            [],
        ),
        (["http.host=0.0.0.0", "http.port=null"], []),  # HTTP off: nothing listens
    ],
)
def test_the_bind_rule(settings: list[str], exposed: list[str]) -> None:
    """Regression: on the old code every one of these started, open, without a word."""
    config = load_config(env={}, overrides=settings)
    assert [line.split(" on ")[0] for line in exposed_planes(config)] == exposed
    if exposed:
        with pytest.raises(ConfigError, match="refusing to listen beyond loopback"):
            check_binds(config)
        insecure = load_config(env={}, overrides=[*settings, "security.allow_insecure=true"])
        warnings = check_binds(insecure)
        assert len(warnings) == len(exposed) and all(w.startswith("INSECURE") for w in warnings)
    else:
        assert check_binds(config) == []


def test_an_http_host_alone_keeps_the_default_port() -> None:
    """Regression: on the old code ``http: {host: ...}`` (or --http-host) alone turned HTTP
    off, since the section's port default was None."""
    assert load_config(env={}, overrides=["http.host=0.0.0.0"]).http.port == DEFAULT_HTTP_PORT


def test_example_configs_and_the_configmap_pass_the_bind_rule() -> None:
    for path in sorted(CONFIGS.glob("*.yaml")):
        if path.name == "store-tiers.yaml":
            continue  # a store config, not a daemon one
        check_binds(load_config(path, env={}))


def test_limits_defaults_and_settings() -> None:
    limits = load_config(env={}).limits
    assert limits.http_max_body_bytes == 16 << 20 and limits.lookup_max_tokens == 1 << 20
    assert limits.http_request_timeout_s == 10.0 and limits.http_keepalive_s == 5.0
    assert limits.http_max_connections == 1024 and limits.http_max_connections_per_ip == 64
    assert limits.peer_handshake_timeout_s == 5.0 and limits.peer_max_handshakes == 256
    assert limits.peer_max_handshakes_per_ip == 32 and limits.peer_max_connections == 512
    assert LOOKUP_TOKENS_CEILING == MAX_TOKENS
    limits = load_config(
        env={"KVFABRIC_LIMITS__HTTP_REQUEST_TIMEOUT_S": "2.5"},
        overrides=["limits.lookup_max_tokens=4096"],
    ).limits
    assert (limits.http_request_timeout_s, limits.lookup_max_tokens) == (2.5, 4096)


def test_lookup_parse_workers_default_and_setting() -> None:
    assert load_config(env={}).limits.http_parse_workers == 2
    assert (
        load_config(env={}, overrides=["limits.http_parse_workers=0"]).limits.http_parse_workers
        == 0
    )  # parse in the daemon's threads
    for bad in ("-1", "65", "true", "2.5"):
        with pytest.raises(ConfigError, match="http_parse_workers: must be an integer"):
            load_config(env={}, overrides=[f"limits.http_parse_workers={bad}"])


@pytest.mark.parametrize(
    "setting, message",
    [
        ("limits.http_max_body_bytes=0", "http_max_body_bytes: must be a positive integer"),
        ("limits.lookup_max_tokens=99999999", "lookup_max_tokens: must be an integer in"),
        ("limits.http_request_timeout_s=0", "http_request_timeout_s: must be a positive"),
        ("limits.http_keepalive_s=never", "http_keepalive_s: must be a positive"),
        ("limits.peer_max_handshakes_per_ip=true", "peer_max_handshakes_per_ip: must be a"),
        ("limits.http_max_connections_per_ip=0", "http_max_connections_per_ip: must be a positive"),
        ("limits.http_max_connections_per_ip=2.5", "http_max_connections_per_ip: must be a"),
        ("limits.peer_handshake_timeout_s=-1", "peer_handshake_timeout_s: must be a positive"),
        ("security.allow_insecure=yes please", "allow_insecure: must be true or false"),
        ("security.tls_key_file=/k.pem", "tls_key_file: needs security.tls_cert_file"),
        ("security.tls_planes=http,smtp", "tls_planes: must be a comma-separated subset"),
        ("security.tls_reload_s=0", "tls_reload_s: must be a positive"),
        ("security.tls_cert", "--set expects key=value"),
        ("security.tls_cert_file_x=1", "unknown key"),
    ],
)
def test_bad_security_settings_are_refused(setting: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(env={}, overrides=[setting])


def test_tls_planes() -> None:
    security = load_config(
        env={}, overrides=["security.tls_cert_file=/c.pem", "security.tls_planes=http"]
    ).security
    assert security.tls_on("http") and not security.tls_on("tcp")
    assert not load_config(env={}).security.tls_on("http")
    assert load_config(env={}, overrides=["security.tls_cert_file=/c.pem"]).security.planes == (
        "http",
        "tcp",
        "peer",
    )


REDIS_TLS = [
    "security.tls_cert_file=/c.pem",
    "tcp.port=0",
    "cluster.index=redis",
    "cluster.redis_url=redis://r:1/0",
]


def test_tls_between_nodes() -> None:
    """Regression: on the old code TLS on the TCP control plane was refused with the redis
    index (peers could not reach a TLS endpoint) and there was no peer plane."""
    config = load_config(env={}, overrides=[*REDIS_TLS, "security.tls_planes=http,tcp"])
    assert config.security.tls_on("tcp") and not config.security.tls_on("peer")
    config = load_config(
        env={},
        overrides=[*REDIS_TLS, "security.tls_client_ca_file=/ca.pem", "cluster.transport=socket"],
    )
    assert config.security.tls_on("peer") and config.security.tls_on("tcp")
    load_config(env={}, overrides=[*REDIS_TLS, "security.tls_client_ca_file=/ca.pem"])  # auto
    # the peer plane is mutual: a node's certificate must be checkable by the others
    with pytest.raises(ConfigError, match="needs security.tls_client_ca_file"):
        load_config(env={}, overrides=REDIS_TLS)
    with pytest.raises(ConfigError, match="nixl is not encrypted"):
        load_config(
            env={},
            overrides=[*REDIS_TLS, "security.tls_client_ca_file=/ca.pem", "cluster.transport=nixl"],
        )
    load_config(
        env={},
        overrides=[
            *REDIS_TLS,
            "security.tls_client_ca_file=/ca.pem",
            "cluster.transport=nixl",
            "security.tls_planes=http,tcp",
        ],
    )
    # one node alone has no peers: the peer plane asks for nothing there
    load_config(env={}, overrides=["security.tls_cert_file=/c.pem", "cluster.transport=nixl"])
