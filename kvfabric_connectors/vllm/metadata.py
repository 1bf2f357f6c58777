"""What the scheduler-side connector tells the worker-side one each step.

vLLM carries :class:`KVFabricMetadata` from the scheduler process to the workers inside its
``SchedulerOutput`` (its own IPC, not a kvfabric wire), so everything here is a plain frozen
value. A request's tokens ``[0, n)`` live in its blocks: token ``t`` in block
``block_ids[t // block_size]`` at offset ``t % block_size``; with several KV cache groups
(vLLM's hybrid manager, :mod:`.groups`) each group has its own block table (``groups``),
and a transfer moves one layer set's objects (``layer_set``).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True)
class ChunkSlice:
    """One kvfabric chunk of a request and the part of it that moves: chunk tokens
    ``[begin, end)``, which are the request's tokens ``[start + begin, start + end)``."""

    key: bytes
    parent: bytes
    start: int  # request token index of the chunk's first token
    num_tokens: int  # tokens in the chunk (chunk_tokens; fewer for a prompt's last chunk)
    begin: int = 0
    end: int = -1  # -1: the whole chunk
    # saves: the chunk's own token ids, int32-LE (the daemon keeps them with it); loads: b""
    tokens: bytes = b""

    @property
    def stop(self) -> int:
        return self.num_tokens if self.end < 0 else self.end


@dataclass(frozen=True)
class RequestTransfer:
    """The chunks of one request to load into, or save from, its blocks this step."""

    req_id: str
    tenant_salt: str
    lora_id: str
    block_ids: tuple[int, ...]
    chunks: tuple[ChunkSlice, ...]
    push_to: str | None = None  # saves: also push the chunks to this node
    background: bool = False  # loads: between steps, reported by get_transfer_results
    layer_set: int = 0  # the objects' layer set (namespace), :mod:`.groups`
    groups: tuple[tuple[int, ...], ...] = ()  # per KV cache group; (): one, ``block_ids``

    def group_blocks(self, group: int) -> tuple[int, ...]:
        """The block table of KV cache group ``group``."""
        return self.groups[group] if self.groups else self.block_ids


@dataclass(frozen=True)
class KVFabricMetadata(KVConnectorMetadata):
    loads: tuple[RequestTransfer, ...] = ()
    saves: tuple[RequestTransfer, ...] = ()
