"""Redis reachability, latency and clock skew against a real redis-server on a random
loopback port; a closed port, wrong credentials and a non-cluster server as negative
controls."""

from __future__ import annotations

from pathlib import Path

import redis
from child_process import free_port
from redis_process import RedisServer

from kvfabric.config import DaemonConfig, load_config
from kvfabric.doctor.index import LATENCY_WARN_S, SKEW_WARN_S, check_index, percentile
from kvfabric.doctor.result import Severity


def _config(tmp_path: Path, url: str) -> DaemonConfig:
    return load_config(
        env={},
        overrides=[
            f"store.data_dir={tmp_path}",
            "cluster.index=redis",
            f"cluster.redis_url={url}",
            "tcp.port=0",
        ],
    )


def test_a_reachable_redis_reports_latency_and_clock_skew(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    latency, clock = check_index(_config(tmp_path, redis_server.url), pings=40)
    values = dict(latency.values)
    assert values["pings"] == 40
    assert 0 < float(values["p50_ms"]) <= float(values["p99_ms"])
    # loopback answers in well under 10 ms, unless the shared CPUs are busy: then the
    # warning must be the latency's
    slow = float(values["p99_ms"]) > LATENCY_WARN_S * 1e3
    assert latency.name == "index.redis"
    assert latency.severity is (Severity.WARN if slow else Severity.OK), latency
    assert f"127.0.0.1:{redis_server.port}" in latency.message and "p99" in latency.message
    # the same host's clock: no skew beyond the round trip
    assert (clock.name, clock.severity) == ("index.clock", Severity.OK)
    skew = abs(float(dict(clock.values)["skew_ms"])) / 1e3
    assert skew < SKEW_WARN_S


def test_a_closed_port_is_an_error_with_the_fix(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    [result] = check_index(_config(tmp_path, f"redis://127.0.0.1:{port}/0"), pings=3)
    assert (result.name, result.severity) == ("index.redis", Severity.ERROR)
    assert f"cannot reach Redis at redis://127.0.0.1:{port}/0" in result.message
    assert f"start redis-server on 127.0.0.1:{port}" in result.fix
    assert f"redis-cli -h 127.0.0.1 -p {port} ping" in result.fix


def test_wrong_credentials_are_an_error_and_never_echoed(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    # set after start: RedisServer's readiness PING carries no password
    with redis.Redis(port=redis_server.port) as admin:
        admin.config_set("requirepass", "right-one")
    url = f"redis://:wrong-one@127.0.0.1:{redis_server.port}/0"
    [result] = check_index(_config(tmp_path, url), pings=3)
    assert result.severity is Severity.ERROR
    assert "credentials" in result.message and "cluster.redis_url" in result.fix
    assert "wrong-one" not in result.message + result.fix


def test_a_cluster_url_naming_a_single_server_is_an_error(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    url = f"redis+cluster://127.0.0.1:{redis_server.port}/0"
    [result] = check_index(_config(tmp_path, url), pings=3)
    assert result.severity is Severity.ERROR and "single server" in result.message
    assert f"redis://127.0.0.1:{redis_server.port}/0" in result.fix


def test_percentiles_are_nearest_rank() -> None:
    samples = [float(i) for i in range(1, 101)]
    assert percentile(samples, 50) == 50.0
    assert percentile(samples, 99) == 99.0
    assert percentile([3.0], 99) == 3.0
