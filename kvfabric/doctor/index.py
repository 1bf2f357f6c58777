"""Global index checks: Redis reachability, round-trip latency and clock skew.

Contract: :func:`check_index` returns ``index.redis`` and (when Redis answered)
``index.clock``, never raising. With ``cluster.index: embedded`` there is nothing to reach
(one ``ok`` result).

* ``index.redis``: one connection to the URL's host (for ``redis+cluster://``, that startup
  node, whose ``CLUSTER INFO`` must say ``cluster_state:ok``); ``pings`` PING round trips
  after a first one that pays the connect. p99 over the index's own socket timeout
  (:data:`INDEX_TIMEOUT_S`) is an error: the daemon's requests would time out; over
  :data:`LATENCY_WARN_S` a warning: every cluster-scope lookup and heartbeat waits for it.
  Unreachable, refused credentials or a URL that names no cluster: error, with the fix;
* ``index.clock``: Redis ``TIME`` against this host's clock, from the round trip with the
  least delay (uncertainty: half of it). Leases are judged on the server's clock, so skew
  does not expire nodes; but logs, events' timestamps and certificates' validity compare
  across hosts: over :data:`SKEW_WARN_S` is a warning.
"""

from __future__ import annotations

import math
import time
from typing import Any
from urllib.parse import urlsplit

from kvfabric.config import DaemonConfig
from kvfabric.doctor.result import CheckResult, Severity

PINGS = 50
TIMEOUT_S = 2.0
INDEX_TIMEOUT_S = 0.5  # kvfabric.cluster.redis_index.RedisIndex's socket_timeout
LATENCY_WARN_S = 0.010
SKEW_WARN_S = 1.0
SKEW_SAMPLES = 5
CLUSTER_SCHEME = "redis+cluster"


def percentile(samples: list[float], q: float) -> float:
    """The nearest-rank ``q`` percentile (0 < q <= 100) of ``samples`` (not empty)."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def check_index(config: DaemonConfig, pings: int = PINGS) -> list[CheckResult]:
    cluster = config.cluster
    if cluster.index != "redis" or not cluster.redis_url:
        return [CheckResult("index.redis", Severity.OK, "embedded index: no Redis to reach")]
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    scheme, _, rest = cluster.redis_url.partition("://")
    is_cluster = scheme.lower() == CLUSTER_SCHEME
    url = f"redis://{rest}" if is_cluster else cluster.redis_url
    shown = cluster.redis_url_redacted
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    client = redis.Redis.from_url(
        url,
        socket_timeout=TIMEOUT_S,
        socket_connect_timeout=TIMEOUT_S,
        retry=Retry(NoBackoff(), 0),
    )
    try:
        started = time.perf_counter()
        client.ping()  # pays the connect (and AUTH / SELECT)
        connect_s = time.perf_counter() - started
        rtts = []
        for _ in range(max(1, pings)):
            started = time.perf_counter()
            client.ping()
            rtts.append(time.perf_counter() - started)
        skew, uncertainty = _skew(client)
        state = _cluster_state(client) if is_cluster else "ok"
    except redis.exceptions.AuthenticationError as exc:
        return [
            CheckResult(
                "index.redis",
                Severity.ERROR,
                f"Redis at {shown} refused the credentials: {exc}",
                "put the right user and password in cluster.redis_url "
                "(redis://USER:PASSWORD@HOST:PORT/0)",
            )
        ]
    except redis.exceptions.ResponseError as exc:
        if is_cluster and "cluster support disabled" in str(exc).lower():
            return [
                CheckResult(
                    "index.redis",
                    Severity.ERROR,
                    f"{shown} names a Redis Cluster, but {host}:{port} is a single server",
                    f"use redis://{host}:{port}/0 for a single server",
                )
            ]
        return [CheckResult("index.redis", Severity.ERROR, f"Redis at {shown}: {exc}", "")]
    except redis.exceptions.RedisError as exc:
        return [
            CheckResult(
                "index.redis",
                Severity.ERROR,
                f"cannot reach Redis at {shown}: {exc}",
                f"start redis-server on {host}:{port}, or correct cluster.redis_url; "
                f"check with `redis-cli -h {host} -p {port} ping`",
            )
        ]
    finally:
        client.close()
    return [_latency(shown, connect_s, rtts, state), _clock(shown, skew, uncertainty)]


def _latency(shown: str, connect_s: float, rtts: list[float], state: str) -> CheckResult:
    p50, p99 = percentile(rtts, 50), percentile(rtts, 99)
    values = (
        ("connect_ms", round(connect_s * 1e3, 3)),
        ("pings", len(rtts)),
        ("p50_ms", round(p50 * 1e3, 3)),
        ("p99_ms", round(p99 * 1e3, 3)),
    )
    figures = (
        f"Redis at {shown}: PING p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms "
        f"({len(rtts)} round trips; connect {connect_s * 1e3:.1f} ms)"
    )
    if state != "ok":
        return CheckResult(
            "index.redis",
            Severity.ERROR,
            f"{figures}; the cluster says cluster_state:{state}",
            "bring the Redis Cluster back to cluster_state:ok (redis-cli --cluster check)",
            values,
        )
    if p99 > INDEX_TIMEOUT_S:
        return CheckResult(
            "index.redis",
            Severity.ERROR,
            f"{figures}: over the index's {INDEX_TIMEOUT_S * 1e3:.0f} ms socket timeout, its "
            "requests would time out",
            "run Redis close to the nodes (same rack / region), or find what delays it "
            "(redis-cli --latency, SLOWLOG GET)",
            values,
        )
    if p99 > LATENCY_WARN_S:
        return CheckResult(
            "index.redis",
            Severity.WARN,
            f"{figures}: every cluster-scope lookup and heartbeat waits for a round trip",
            "run Redis close to the nodes, or find what delays it (redis-cli --latency)",
            values,
        )
    return CheckResult("index.redis", Severity.OK, figures, values=values)


def _skew(client: Any) -> tuple[float, float]:
    """(server clock - this host's, half the round trip of the best sample) in seconds."""
    best_rtt, skew = float("inf"), 0.0
    for _ in range(SKEW_SAMPLES):
        before = time.time()
        seconds, micros = client.time()
        after = time.time()
        if after - before < best_rtt:
            best_rtt = after - before
            skew = seconds + micros / 1e6 - (before + after) / 2
    return skew, best_rtt / 2


def _cluster_state(client: Any) -> str:
    info = client.execute_command("CLUSTER", "INFO")
    text = info.decode() if isinstance(info, bytes) else str(info)
    for line in text.splitlines():
        if line.startswith("cluster_state:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _clock(shown: str, skew: float, uncertainty: float) -> CheckResult:
    values = (("skew_ms", round(skew * 1e3, 3)), ("uncertainty_ms", round(uncertainty * 1e3, 3)))
    figures = (
        f"this host's clock is {abs(skew) * 1e3:.1f} ms "
        f"{'behind' if skew > 0 else 'ahead of'} Redis at {shown} "
        f"(± {uncertainty * 1e3:.1f} ms)"
    )
    if abs(skew) - uncertainty > SKEW_WARN_S:
        return CheckResult(
            "index.clock",
            Severity.WARN,
            f"{figures}: leases use the server's clock, but logs, event timestamps and "
            "certificate validity across nodes do not line up",
            "run time synchronisation (chrony / systemd-timesyncd) on this node and the Redis host",
            values,
        )
    return CheckResult("index.clock", Severity.OK, figures, values=values)
