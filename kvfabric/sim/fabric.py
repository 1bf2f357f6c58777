"""The fabric in a simulated cluster: which node holds which shared prefix, in which tier.

Per node two LRU tiers of a capacity in tokens: DRAM, then SSD (what DRAM evicts moves to SSD;
what SSD evicts is gone). A prefill stores its request's shared prefix on the prefill node
(in DRAM). A request reusing a prefix its node holds on SSD first reads it back at
``ssd_bytes_per_s`` (and it returns to DRAM). The planner sees the holdings (any tier), as a
gateway sees a cluster lookup; hits are counted per tier.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FabricSpec:
    dram_tokens: int = 0  # per node
    ssd_tokens: int = 0  # per node
    ssd_bytes_per_s: float = 2e9

    def __post_init__(self) -> None:
        if self.dram_tokens < 0 or self.ssd_tokens < 0 or not self.ssd_bytes_per_s > 0:
            raise ValueError("tier capacities must be >= 0 and ssd_bytes_per_s > 0")


@dataclass
class FabricCounters:
    lookups: int = 0
    dram_hits: int = 0
    ssd_hits: int = 0
    remote_hits: int = 0  # held on another node only
    hit_tokens: dict[str, int] = field(default_factory=collections.Counter)


class _Tier:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.items: collections.OrderedDict[int, int] = collections.OrderedDict()

    def put(self, group: int, tokens: int) -> list[tuple[int, int]]:
        """Store (most recent); returns what it evicted to make room."""
        self.remove(group)
        if tokens > self.capacity:
            return [(group, tokens)]
        evicted = []
        while self.used + tokens > self.capacity:
            old, size = self.items.popitem(last=False)
            self.used -= size
            evicted.append((old, size))
        self.items[group] = tokens
        self.used += tokens
        return evicted

    def remove(self, group: int) -> int:
        size = self.items.pop(group, 0)
        self.used -= size
        return size


class SimFabric:
    def __init__(self, spec: FabricSpec, nodes: list[str], kv_bytes_per_token: int) -> None:
        self.spec = spec
        self.kv_bytes_per_token = kv_bytes_per_token
        self._dram = {n: _Tier(spec.dram_tokens) for n in nodes}
        self._ssd = {n: _Tier(spec.ssd_tokens) for n in nodes}
        self.counters = FabricCounters()

    def holdings(self, group: int, shared_tokens: int) -> dict[str, int]:
        """Per node, the tokens of the prefix it can serve (any tier)."""
        if group < 0 or not shared_tokens:
            return {}
        out = {}
        for node in self._dram:
            held = self._dram[node].items.get(group) or self._ssd[node].items.get(group) or 0
            if held:
                out[node] = min(held, shared_tokens)
        return out

    def reuse(self, node: str, group: int, tokens: int) -> float:
        """A request on ``node`` reuses ``tokens`` of ``group``'s prefix: the seconds of reading
        it from this node's SSD (0 from DRAM or when it came from elsewhere); counts the hit."""
        self.counters.lookups += 1
        if group < 0 or not tokens:
            return 0.0
        if group in self._dram[node].items:
            self._dram[node].items.move_to_end(group)
            self._count("dram", tokens)
            return 0.0
        if group in self._ssd[node].items:
            self._ssd[node].remove(group)
            self._store_dram(node, group, tokens)
            self._count("ssd", tokens)
            return tokens * self.kv_bytes_per_token / self.spec.ssd_bytes_per_s
        self._count("remote", tokens)
        return 0.0

    def store(self, node: str, group: int, tokens: int) -> None:
        if group >= 0 and tokens:
            self._store_dram(node, group, tokens)

    def _store_dram(self, node: str, group: int, tokens: int) -> None:
        self._ssd[node].remove(group)
        for old, size in self._dram[node].put(group, tokens):
            self._ssd[node].put(old, size)  # what SSD then evicts is gone

    def _count(self, tier: str, tokens: int) -> None:
        c = self.counters
        if tier == "dram":
            c.dram_hits += 1
        elif tier == "ssd":
            c.ssd_hits += 1
        else:
            c.remote_hits += 1
        c.hit_tokens[tier] += tokens
