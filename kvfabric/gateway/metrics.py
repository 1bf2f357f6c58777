"""The gateway's Prometheus series, on a registry of its own (``GET /metrics``).

Tenant labels come from configured API keys or from a header the operator chose to trust;
a label per distinct tenant is bounded by ``MAX_TENANT_LABELS`` (others count as
``other``) so a caller inventing tenant names cannot grow the registry without bound.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

MAX_TENANT_LABELS = 256
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge(
            "kvfabric_gateway_queue_depth",
            "requests waiting in the gateway",
            ["tenant"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "kvfabric_gateway_queue_wait_seconds",
            "time from arrival to dispatch",
            ["tenant", "priority"],
            buckets=_LATENCY,
            registry=r,
        )
        self.decisions = Counter(
            "kvfabric_gateway_decisions",
            "plans carried out, by mode and goal (latency, cost) or retry",
            ["mode", "reason"],
            registry=r,
        )
        self.phase = Histogram(
            "kvfabric_gateway_phase_seconds",
            "time of each phase of a request (tokenize, lookup, prefill, decode)",
            ["phase"],
            buckets=_LATENCY,
            registry=r,
        )
        self.ttft = Histogram(
            "kvfabric_gateway_ttft_seconds",
            "arrival to first output byte (streams) or whole answer",
            ["tenant", "priority"],
            buckets=_LATENCY,
            registry=r,
        )
        self.tpot = Histogram(
            "kvfabric_gateway_tpot_seconds",
            "time per output token after the first (streams)",
            ["tenant", "priority"],
            buckets=_TPOT,
            registry=r,
        )
        self.rejected = Counter(
            "kvfabric_gateway_rejected",
            "requests refused (queue_full, deadline, no_engine, engine_failed)",
            ["tenant", "reason"],
            registry=r,
        )
        self.served_tokens = Counter(
            "kvfabric_gateway_served_tokens",
            "prompt plus output tokens of finished requests",
            ["tenant"],
            registry=r,
        )
        self.engine_healthy = Gauge(
            "kvfabric_gateway_engine_healthy", "1 while the engine answers", ["engine"], registry=r
        )
        self.engine_running = Gauge(
            "kvfabric_gateway_engine_running",
            "requests in flight there",
            ["engine"],
            registry=r,
        )
        self.retries = Counter(
            "kvfabric_gateway_retries",
            "requests moved off an engine that failed",
            ["engine"],
            registry=r,
        )
        self.isolated = Counter(
            "kvfabric_gateway_isolated",
            "requests of tenants below their share served into isolation slots, out of order",
            ["tenant"],
            registry=r,
        )
        self.advised_engines = Gauge(
            "kvfabric_gateway_advised_engines",
            "the P:D advice for the observed ingress: engines per role and class",
            ["role", "hardware_class"],
            registry=r,
        )
        self.advised_cost = Gauge(
            "kvfabric_gateway_advised_cost_per_hour",
            "the price per hour of the advised composition",
            registry=r,
        )
        self.ingress_rate = Gauge(
            "kvfabric_gateway_ingress_rate_rps",
            "requests per second finished over the advisor's window",
            registry=r,
        )
        self.lookups = Counter(
            "kvfabric_gateway_lookups",
            "fabric lookups by outcome (ok, failed)",
            ["outcome"],
            registry=r,
        )
        self._tenants: set[str] = set()

    def tenant(self, name: str) -> str:
        """``name`` as a label value (``other`` past MAX_TENANT_LABELS distinct tenants)."""
        if name in self._tenants:
            return name
        if len(self._tenants) >= MAX_TENANT_LABELS:
            return "other"
        self._tenants.add(name)
        return name
