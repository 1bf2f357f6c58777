"""The values a scheduling decision reads: frozen, validated on construction.

Units: tokens, tokens per second, bytes, bytes per second, seconds, and a hardware class's
price in currency units per hour (only ratios between classes matter).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field


class Role(enum.Enum):
    """What an engine serves: the prefill phase, the decode phase, or both (monolithic)."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"

    def prefills(self) -> bool:
        return self is not Role.DECODE

    def decodes(self) -> bool:
        return self is not Role.PREFILL


class Priority(enum.Enum):
    """Interactive requests are served before batch ones (strict priority)."""

    INTERACTIVE = "interactive"
    BATCH = "batch"


@dataclass(frozen=True)
class Request:
    """One request as the scheduler sees it: its tenant and class, the prompt's length and
    the output it may produce."""

    tenant: str
    prompt_tokens: int
    max_output_tokens: int
    priority: Priority = Priority.INTERACTIVE

    def __post_init__(self) -> None:
        _non_negative("prompt_tokens", self.prompt_tokens)
        _non_negative("max_output_tokens", self.max_output_tokens)

    @property
    def budget_tokens(self) -> int:
        """What the request may cost in tokens: its prompt plus its longest output."""
        return self.prompt_tokens + self.max_output_tokens


@dataclass(frozen=True)
class EngineState:
    """One engine as last observed. ``prefill_tps`` / ``decode_tps``: measured throughput
    (tokens per second of one request's prefill; decode tokens per second of one stream);
    ``queued_tokens``: prompt tokens waiting to be prefilled there (what the gateway sent and
    has not seen start); ``free_kv_tokens``: KV the engine can still hold; ``pushes``: as a
    prefill engine it pushes its KV layer by layer to the decode node (a hand-off from one
    that does not is a pull after its prefill)."""

    engine_id: str
    node_id: str
    hardware_class: str
    role: Role
    prefill_tps: float
    decode_tps: float
    queued_tokens: int = 0
    running: int = 0
    free_kv_tokens: int = 1 << 62
    healthy: bool = True
    pushes: bool = True  # as a prefill engine, streams its KV to the decode node (else pulled)

    def __post_init__(self) -> None:
        for name in ("prefill_tps", "decode_tps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        _non_negative("queued_tokens", self.queued_tokens)
        _non_negative("running", self.running)
        _non_negative("free_kv_tokens", self.free_kv_tokens)


@dataclass(frozen=True)
class HardwareProfile:
    """A hardware class's price per hour (what a second of one of its engines costs)."""

    name: str
    cost_per_hour: float

    def __post_init__(self) -> None:
        if self.cost_per_hour < 0:
            raise ValueError(f"cost_per_hour must be >= 0, got {self.cost_per_hour!r}")


@dataclass(frozen=True)
class Holdings:
    """What the fabric holds of the request's prompt: per node, the tokens of the longest
    prefix it can serve (any tier). A node missing from ``tokens_by_node`` holds none."""

    tokens_by_node: Mapping[str, int] = field(default_factory=dict)

    def on(self, node_id: str) -> int:
        return self.tokens_by_node.get(node_id, 0)

    def best(self) -> tuple[str, int]:
        """The node holding the longest prefix (ties: the smallest node id), or ("", 0)."""
        if not self.tokens_by_node:
            return "", 0
        node = min(self.tokens_by_node, key=lambda n: (-self.tokens_by_node[n], n))
        return node, self.tokens_by_node[node]


@dataclass(frozen=True)
class Link:
    """How chunks move between nodes: ``bytes_per_s`` of the path, ``kv_bytes_per_token``
    of the model, and ``overlap``: the share of a prefill's own KV that streaming lands
    while it is computed (pushed layer by layer: what ``pd_stream_bench`` measures)."""

    bytes_per_s: float
    kv_bytes_per_token: int
    overlap: float = 0.95

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0:
            raise ValueError("bytes_per_s must be positive")
        _non_negative("kv_bytes_per_token", self.kv_bytes_per_token)
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError("overlap must be in [0, 1]")

    def seconds(self, tokens: int) -> float:
        """Time to move the KV of ``tokens`` tokens, not overlapped with anything."""
        return tokens * self.kv_bytes_per_token / self.bytes_per_s


def _non_negative(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
