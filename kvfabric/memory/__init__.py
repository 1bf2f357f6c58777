"""Memory: shared-memory arenas, the page allocator, NUMA binding, scatter-gather copies."""

from kvfabric.memory.arena import SharedArena
from kvfabric.memory.pages import PageAllocator

__all__ = ["PageAllocator", "SharedArena"]
