"""The control protocol's operations, as data: every argument each one reads (wire type,
limits as the validators of :mod:`kvfabric.protocol.messages` enforce them), its result, who
may send it, and the error kinds it adds to the common ones.

This table is the one description of the operations: ``docs/protocol.md`` is generated from
it (:mod:`kvfabric.protocol.doc`), and ``tests/unit/protocol/test_ops.py`` checks it against
the daemon's handlers (:mod:`kvfabric.server.handlers`): every field a handler reads is listed
here, and no other. A new field is added here first; the test then names what is missing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvfabric.hashing import KEY_BYTES
from kvfabric.protocol.messages import (
    MAX_BATCH,
    MAX_KEYS,
    MAX_STRING,
    MAX_TIMEOUT_S,
    MAX_TOKENS,
    Op,
)


class Access(str, enum.Enum):
    """Who may send an operation (with auth on; with it off every session is the admin)."""

    ANY = "any"
    WRITER = "writer"  # any session but one that said ``access: "read"`` in hello
    ADMIN = "admin"  # the admin token


@dataclass(frozen=True)
class Field:
    """One argument. ``items``: the fields of each entry of a list of maps."""

    name: str
    type: str
    doc: str
    required: bool = True
    items: tuple[Field, ...] = ()


@dataclass(frozen=True)
class OpSpec:
    op: Op
    doc: str
    fields: tuple[Field, ...]
    result: str
    local: bool = False  # Unix socket only: it maps shared memory or fills this node's memory
    access: Access = Access.ANY
    batch: bool = False  # the result is one item per request entry, each ok or its own error
    errors: tuple[str, ...] = ()  # kinds beyond the common ones (see COMMON_ERRORS)


# every request after hello may fail with these
COMMON_ERRORS = ("bad_request", "forbidden", "unsupported_version", "unavailable", "internal")

_TIMEOUT = f"number in [0, {MAX_TIMEOUT_S:g}] s"
_KEY = f"bin ({KEY_BYTES} bytes)"
_KEYS = f"bin[] or bin (≤ {MAX_KEYS} keys)"
_LEASE_IDS = f"int[] (1 to {MAX_BATCH})"

NS = Field("ns", "map", "the namespace: `model`, `spec` (KVSpec fields), `tenant`, `lora`")
KEY = Field("key", _KEY, "the chunk's key")
KEYS = Field(
    "keys",
    _KEYS,
    "chunk keys: a list, or packed back to back in one bin (the `packed_keys` feature)",
)
KEYS_OR_TOKENS = Field("keys", _KEYS, "the chain's chunk keys; or `tokens`", required=False)
TOKENS = Field(
    "tokens",
    f"bin (int32-LE, ≤ {MAX_TOKENS} tokens)",
    "token ids, hashed by the daemon into the keys of their full chunks; or `keys`",
    required=False,
)
LEASE = Field("lease", "int ≥ 0", "a lease id this session holds")
LEASES = Field("leases", _LEASE_IDS, "lease ids this session holds")
WANT = Field(
    "want",
    "map",
    "how the consumer will read the chunk (ReadSpec: `dtype`, `heads` [start, end), "
    "`layout` `hnd` or `nhd`); checked against the namespace before pinning "
    "(the `read_spec` feature)",
    required=False,
)
LAYERS = Field(
    "layers",
    "int",
    "bit mask of the layers to commit, in [1, 2^num_layers - 1]; absent: every layer",
    required=False,
)
_RESERVE_FIELDS = (
    KEY,
    Field("parent", _KEY, "the previous chunk's key; absent: the chain's root", required=False),
    Field(
        "num_tokens",
        "int",
        "tokens in the chunk, in [1, chunk_tokens]; absent: chunk_tokens",
        required=False,
    ),
    Field(
        "heads",
        "[int, int]",
        "[start, end) of the KV heads this writer holds (one tensor-parallel rank); absent: all",
        required=False,
    ),
    Field(
        "tokens",
        "bin (int32-LE, num_tokens ids)",
        "the chunk's own token ids, kept with it (inventory, restarts, peer copies); they must "
        "hash to `key` with `parent` and the namespace, else `bad_request` and nothing is "
        "reserved; absent: none (a rank joining a chunk may omit them)",
        required=False,
    ),
)
ITEMS = Field("items", f"map[] (1 to {MAX_BATCH})", "one entry per chunk", items=_RESERVE_FIELDS)
PEER_ITEMS = Field(
    "items",
    f"map[] (1 to {MAX_BATCH})",
    "one entry per chunk",
    items=(
        *_RESERVE_FIELDS,
        Field(
            "wire",
            '"fp8" or "native"',
            "how the chunk's layers will travel; `fp8`: staged encoded, and the reply names "
            "the staging room (`staging`) when this node takes fp8 for it; absent: native",
            required=False,
        ),
    ),
)
_PLACEMENT = (
    "`lease`, `tier` (index), `arena` (absent: not an arena a client maps), `pages` (bin of "
    "uint32-LE page ids), `nbytes`, `num_tokens`, `lease_s` (seconds left on the lease)"
)
_WRITE_ERRORS = ("exists", "no_capacity", "quota_exceeded", "deadline", "spec_mismatch")
_READ_ERRORS = ("not_found", "spec_mismatch", "deadline", "aborted", "corrupt", "bad_spec")

OPS: tuple[OpSpec, ...] = (
    OpSpec(
        Op.HELLO,
        "Start a session (the first request of every connection).",
        (
            Field("token", "str", "the admin's or a tenant's token (auth on)", required=False),
            Field("client", f"str (≤ {MAX_STRING})", "the client's name (metrics)", False),
            Field(
                "access", "`read` or `write`", "`read`: read-only descriptors, no reserve", False
            ),
        ),
        "`protocol`, `node_id`, `tenant` (null: the admin), `shared_memory`, `tiers`, `arenas` "
        "([{`arena`, `tier`, `index`, `size`, `page_size`, `writable`}]; their descriptors "
        "follow by SCM_RIGHTS on the Unix socket), `limits` {`max_keys`, `max_tokens`, "
        "`max_leases`}, `features`",
        errors=("unauthorized",),
    ),
    OpSpec(
        Op.LOOKUP,
        "The longest stored prefix of a chain; with `scope: cluster` also what other nodes hold.",
        (
            NS,
            KEYS_OR_TOKENS,
            TOKENS,
            Field(
                "num_tokens",
                "int",
                "with `keys`: the tokens the chain covers, in [(n - 1) * chunk_tokens + 1, "
                "n * chunk_tokens] (a partial last chunk); absent: n * chunk_tokens",
                required=False,
            ),
            Field("scope", "`local` or `cluster`", "absent: local", required=False),
        ),
        "`requested_chunks`, `chunks`, `tokens`, `tier_tokens` {tier: tokens}, "
        "`requested_tokens`; cluster scope adds `nodes` (per node: id, epoch, hardware class, "
        "leading chunks, per tier), `stale`, `peer_tokens`",
        errors=("unsupported",),
    ),
    OpSpec(
        Op.RESERVE,
        "Reserve pages for one chunk; the client writes them, then commits.",
        (NS, *_RESERVE_FIELDS),
        _PLACEMENT,
        local=True,
        access=Access.WRITER,
        errors=_WRITE_ERRORS,
    ),
    OpSpec(
        Op.COMMIT,
        "Publish written layers of a reservation; the last commit completes the chunk.",
        (LEASE, LAYERS),
        "`done` (the chunk is complete and the lease ended); while not done, `lease_s` (the "
        "lease, renewed by this commit)",
        local=True,
        errors=("lease_expired", "aborted"),
    ),
    OpSpec(
        Op.ABORT,
        "Drop a reservation (or a pin) this session holds.",
        (LEASE,),
        "null",
        local=True,
    ),
    OpSpec(
        Op.GET,
        "Pin one chunk for reading (possibly still being written: see `ready`).",
        (
            NS,
            KEY,
            Field("timeout", _TIMEOUT, "bound on waiting for an SSD read-back", required=False),
            WANT,
        ),
        f"{_PLACEMENT}, `ready` (bit mask of committed layers); with `want`: `conversions` "
        "(what the read converts; absent: zero copy), `convert_at` (`consumer`)",
        local=True,
        errors=_READ_ERRORS,
    ),
    OpSpec(
        Op.WAIT_LAYER,
        "Wait until a layer of a pinned chunk is committed.",
        (
            LEASE,
            Field("layer", "int", "in [0, num_layers - 1]"),
            Field("timeout", _TIMEOUT, "absent or 0: 30 s", required=False),
        ),
        "`ready` (bit mask of committed layers)",
        local=True,
        errors=("deadline", "aborted", "lease_expired"),
    ),
    OpSpec(
        Op.RELEASE,
        "Give back a pin (or drop a reservation).",
        (LEASE,),
        "null",
        local=True,
        errors=("lease_expired",),
    ),
    OpSpec(
        Op.RESERVE_BATCH,
        "`reserve` for many chunks of one namespace.",
        (NS, ITEMS),
        "per item: as `reserve`",
        local=True,
        access=Access.WRITER,
        batch=True,
        errors=_WRITE_ERRORS,
    ),
    OpSpec(
        Op.COMMIT_BATCH,
        "`commit` for many reservations, with one layer mask.",
        (LEASES, LAYERS),
        "per lease: as `commit`",
        local=True,
        batch=True,
        errors=("lease_expired", "aborted"),
    ),
    OpSpec(
        Op.GET_BATCH,
        "`get` for many chunks of one namespace.",
        (
            NS,
            Field("keys", f"bin[] (1 to {MAX_BATCH})", "chunk keys, one item each"),
            Field("timeout", _TIMEOUT, "as `get`'s, for each item", required=False),
            WANT,
        ),
        "per key: as `get`",
        local=True,
        batch=True,
        errors=_READ_ERRORS,
    ),
    OpSpec(
        Op.RELEASE_BATCH,
        "`release` for many leases.",
        (LEASES,),
        "per lease: null",
        local=True,
        batch=True,
        errors=("lease_expired",),
    ),
    OpSpec(Op.CONTAINS, "Which chunks are stored.", (NS, KEYS), "[bool, ...] in key order"),
    OpSpec(Op.DELETE, "Delete one chunk.", (NS, KEY), "bool: it was stored"),
    OpSpec(
        Op.STATS,
        "The node's statistics.",
        (),
        "per tier and total: capacity, used, objects, hits, evictions, moves, bytes",
        access=Access.ADMIN,
    ),
    OpSpec(Op.PING, "Liveness.", (), '"pong"'),
    OpSpec(
        Op.KV_EVENTS,
        "A namespace's inventory changes since a position, as vLLM KV events (an engine "
        "connector's `take_events`).",
        (
            NS,
            Field(
                "after", "int ≥ -1", "the `next` of the previous poll; -1: start with a snapshot"
            ),
            Field("block_size", "int", "the engine's block size; divides the chunk size"),
            Field("max", "int", "at most this many changes (absent: 4096)", required=False),
        ),
        "`next` (the position for the next poll), `events` (vLLM `BlockStored` / "
        "`BlockRemoved` / `AllBlocksCleared` maps: `type` and fields), `snapshot` (the events "
        "start with `AllBlocksCleared` and the namespace's inventory: the first poll, or a "
        "poll that fell behind the change log), `truncated` (a snapshot cut at `max`)",
    ),
    OpSpec(
        Op.INTEND,
        "Announce chunks the caller's engine is about to compute, on the node's KV event "
        "stream, before they are reserved (withdrawn after `kv_events.intent_ttl_s` unless "
        "written meanwhile).",
        (
            NS,
            Field(
                "items",
                f"map[] (1 to {MAX_BATCH})",
                "one entry per chunk",
                items=(
                    KEY,
                    _RESERVE_FIELDS[1],
                    _RESERVE_FIELDS[2],
                    Field(
                        "tokens",
                        "bin (int32-LE, num_tokens ids)",
                        "the chunk's own token ids; they must hash to `key` with `parent` and "
                        "the namespace, else `bad_request` and nothing is announced",
                    ),
                ),
            ),
        ),
        "`announced` (chunks neither held here nor announced already)",
        access=Access.WRITER,
        errors=("unsupported",),
    ),
    OpSpec(
        Op.PREFETCH,
        "Pull the chunks this node lacks from the nodes that hold them (cluster nodes).",
        (
            NS,
            KEYS_OR_TOKENS,
            TOKENS,
            Field("timeout", _TIMEOUT, "absent or 0: 10 s", required=False),
        ),
        "`pulled`, `already_local`, `missing` (chunks), `source` (the node pulled from, or null)",
        local=True,
        errors=("unsupported",),
    ),
    OpSpec(
        Op.PUSH,
        "Push chunks to another node, layer by layer as they are committed here.",
        (
            NS,
            KEYS,
            Field("target", f"str (≤ {MAX_STRING})", "the target's node id"),
            Field("timeout", _TIMEOUT, "absent or 0: 10 s", required=False),
            Field(
                "wire",
                '"fp8" or "native"',
                "how the layers travel (fp8: e4m3 with per-(layer, k|v, head) scales, landing "
                "in the namespace's dtype on the target); absent: as `cluster.fp8_wire_peers` says",
                required=False,
            ),
        ),
        "`pushed`, `already_there`, `failed` (distinct chunks), `target_class`, `wire_bytes` "
        "(bytes the transport moved) and `native_bytes` (what they were in the namespace's "
        "dtype); when it moved "
        "layers, also how it kept up with the chunks' producer: `landed_fraction` (the share "
        "of layers on the target when the last one was committed here), `tail_ms` (from then "
        "to the last layer's commit on the target), `layers_moved` and `batches` (transfers: "
        "one per layer while the pusher keeps up, several layers in one when it fell behind)",
        local=True,
        errors=("unsupported",),
    ),
    OpSpec(
        Op.PEER_PIN,
        "Node to node (TCP): pin chunks a peer is about to read over its transport.",
        (
            NS,
            KEYS,
            Field("timeout", _TIMEOUT, "bound on waiting for each chunk", False),
            Field(
                "wire",
                '"fp8" or "native"',
                "`fp8`: also stage each chunk this node can encode as fp8; absent: native",
                required=False,
            ),
        ),
        f"per key: {_PLACEMENT}, `page_size`, `parent`, `tokens` (when the chunk has them); "
        "asked with `wire: fp8`, `staging` where this node encoded it (`arena` = the staging "
        "region, `pages`, `page_size`, `nbytes`, `checksum`: xxh3-64 of the encoded bytes)",
        access=Access.ADMIN,
        batch=True,
        errors=_READ_ERRORS,
    ),
    OpSpec(
        Op.PEER_RELEASE,
        "Node to node: give back pins taken by `peer_pin`.",
        (LEASES,),
        "per lease: null",
        access=Access.ADMIN,
        batch=True,
        errors=("lease_expired",),
    ),
    OpSpec(
        Op.PEER_RESERVE,
        "Node to node (TCP): reserve chunks a peer will push.",
        (NS, PEER_ITEMS),
        f"per item: {_PLACEMENT}, `page_size`; for an item asked with `wire: fp8` that this "
        "node takes as fp8, `staging`: where to write its encoded layers (`arena` = the "
        "staging region, `pages`, `page_size`, `nbytes`); without it the chunk goes native",
        access=Access.ADMIN,
        batch=True,
        errors=_WRITE_ERRORS,
    ),
    OpSpec(
        Op.PEER_COMMIT,
        "Node to node: commit layers of reservations taken by `peer_reserve`.",
        (
            LEASES,
            Field("layers", "int ≥ 1", "bit mask of the layers to commit"),
            Field(
                "checksums",
                "(uint64 | null)[]",
                "per lease: the xxh3-64 of the committed layers' encoded bytes in staging, for "
                "a chunk travelling as fp8 (decoded into the reservation once it matches; a "
                "mismatch refuses the commit and aborts the reservation); null or absent: native",
                required=False,
            ),
        ),
        "per lease: `done`",
        access=Access.ADMIN,
        batch=True,
        errors=("lease_expired", "aborted"),
    ),
    OpSpec(
        Op.PEER_ABORT,
        "Node to node: drop reservations taken by `peer_reserve`.",
        (LEASES,),
        "per lease: null",
        access=Access.ADMIN,
        batch=True,
    ),
)

OP_SPECS: dict[Op, OpSpec] = {spec.op: spec for spec in OPS}


def field_paths(spec: OpSpec) -> set[str]:
    """Every argument of ``spec``, an item's fields as ``items[].name``."""
    paths = set()
    for f in spec.fields:
        paths.add(f.name)
        paths.update(f"{f.name}[].{item.name}" for item in f.items)
    return paths
