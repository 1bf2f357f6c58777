"""What the node says about its inventory in vLLM's KV event vocabulary.

:class:`Announcer` turns :class:`~kvfabric.kvevents.log.Change` records (and store snapshots)
into vLLM events for one engine block size: ``BlockStored`` for an object stored in (or
moved to) a tier, with that tier's medium; ``BlockRemoved`` for an object gone from a tier.
A namespace is announced only if ``include(ns)`` says so (tenancy: token ids are prompts)
and its chunks split into whole blocks; a stored object whose writer gave no token ids
cannot be announced (consumers hash token ids) and is counted in ``unannounced``.

The medium is vLLM's name for how far the bytes are from an engine on this node (``GPU``,
``CPU``, ``STORAGE``: :data:`MEDIUM_OF_KIND`), so a consumer weighs fabric tiers as it
weighs vLLM's own offloading tiers.

Not thread-safe: one announcer per reader.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from kvfabric.kvevents.blocks import blocks_per_chunk, chunk_block_hashes, engine_blocks
from kvfabric.kvevents.log import Change
from kvfabric.kvevents.wire import Event, all_blocks_cleared, block_removed, block_stored
from kvfabric.spec import Namespace
from kvfabric.store.protocol import StoredObject
from kvfabric.tiers.base import TierKind

MEDIUM_OF_KIND = {
    TierKind.DEVICE: "GPU",
    TierKind.DRAM: "CPU",
    TierKind.CXL: "CPU",
    TierKind.SSD: "STORAGE",
}


class Announcer:
    """vLLM events for one block size and one view of the namespaces."""

    def __init__(
        self,
        block_size: int,
        medium_of_tier: Mapping[str, str],
        include: Callable[[Namespace], bool],
    ) -> None:
        self.block_size = block_size
        self._medium = dict(medium_of_tier)
        self._include = include
        self.unannounced = 0  # stored objects without token ids

    def _announces(self, ns: Namespace) -> bool:
        if not self._include(ns):
            return False
        try:
            blocks_per_chunk(ns.spec.chunk_tokens, self.block_size)
        except ValueError:
            return False
        return True

    def _stored(
        self, ns: Namespace, key: bytes, parent: bytes, tier: str, tokens: bytes | None
    ) -> Event | None:
        if tokens is None:
            self.unannounced += 1
            return None
        blocks = engine_blocks(key, parent, tokens, ns.spec.chunk_tokens, self.block_size)
        if blocks is None:
            return None
        return block_stored(blocks, self._medium[tier], ns.lora_id or None)

    def events(self, changes: Iterable[Change]) -> list[Event]:
        """The events of ``changes``, in order."""
        out: list[Event] = []
        for change in changes:
            if not self._announces(change.ns):
                continue
            if change.stored:
                event = self._stored(
                    change.ns, change.key, change.parent, change.tier, change.tokens
                )
                if event is not None:
                    out.append(event)
            else:
                # the removed object's size is not known: name every block a full chunk
                # has (consumers ignore hashes they never saw)
                hashes = chunk_block_hashes(
                    change.key, change.ns.spec.chunk_tokens, self.block_size
                )
                out.append(block_removed(list(hashes), self._medium[change.tier]))
        return out

    def snapshot(self, objects: Iterable[StoredObject]) -> list[Event]:
        """``AllBlocksCleared`` and then every announceable object of ``objects`` as stored,
        parents first: what a subscriber that lost track needs to know the inventory again."""
        out = [all_blocks_cleared()]
        for obj in parents_first(objects):
            if self._announces(obj.ns):
                event = self._stored(obj.ns, obj.key, obj.parent, obj.tier, obj.tokens)
                if event is not None:
                    out.append(event)
        return out


def parents_first(objects: Iterable[StoredObject]) -> list[StoredObject]:
    """``objects`` with every object after its parent (when its parent is among them):
    consumers drop a stored block whose parent they have not seen."""
    objs = list(objects)
    by_key: dict[bytes, list[StoredObject]] = {}
    for obj in objs:
        by_key.setdefault(obj.key, []).append(obj)
    children: dict[bytes, list[bytes]] = {}
    roots: list[bytes] = []
    for key, copies in by_key.items():
        parent = copies[0].parent
        if parent in by_key and parent != key:
            children.setdefault(parent, []).append(key)
        else:
            roots.append(key)
    out: list[StoredObject] = []
    stack = list(reversed(roots))
    while stack:
        key = stack.pop()
        out += by_key[key]
        stack += reversed(children.get(key, ()))
    return out
