"""Head shards: one object written by several tensor-parallel ranks, one KV-head range each.

A producer with tensor parallelism R holds ``num_kv_heads / R`` heads per rank. Every rank
reserves the same chunk with its own head range (:meth:`TieredStore.reserve` with
``heads=``) and commits layers of that range; a layer becomes readable when every head of it
has landed, and the object is complete when every layer is. Ranges must not overlap; a rank
that aborts or lets its lease expire aborts the whole object (a layer with a hole in it must
never be served). Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfabric.errors import AlreadyExistsError, SpecError

HeadRange = tuple[int, int]


def head_mask(heads: HeadRange, num_heads: int) -> int:
    start, end = heads
    if not 0 <= start < end <= num_heads:
        raise SpecError(f"head range [{start}, {end}) outside [0, {num_heads})")
    return ((1 << (end - start)) - 1) << start


@dataclass
class HeadShards:
    """Which heads writers claimed, and per layer which heads are committed."""

    num_heads: int
    num_layers: int
    claimed: int = 0
    committed: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.committed = [0] * self.num_layers

    @property
    def all_heads(self) -> int:
        return (1 << self.num_heads) - 1

    def claim(self, heads: HeadRange) -> int:
        """Claim a head range for a new writer; its head mask."""
        mask = head_mask(heads, self.num_heads)
        if self.claimed & mask:
            raise AlreadyExistsError(
                f"heads [{heads[0]}, {heads[1]}) of this chunk are already being written"
            )
        self.claimed |= mask
        return mask

    def commit(self, heads: int, layers: int) -> int:
        """Record ``heads`` committed in the layers of mask ``layers``; returns the mask of
        layers that are now complete (every head landed)."""
        complete = 0
        for layer in range(self.num_layers):
            if layers >> layer & 1:
                self.committed[layer] |= heads
            if self.committed[layer] == self.all_heads:
                complete |= 1 << layer
        return complete
