"""Request handlers: one function per protocol operation.

Each handler takes the session and the request's ``args`` map, validates every argument
(:mod:`kvfabric.protocol.messages` validators raise ``ProtocolError``) and returns a
msgpack-able result or raises a :class:`~kvfabric.errors.KVFabricError`, which the control
server turns into an error reply. ``blocking`` handlers (they may wait for room, an SSD
read or a layer) run in the daemon's thread pool; the others run on the event loop and
only take the store lock briefly. ``local`` handlers touch shared memory and are refused on
TCP sessions.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvfabric.auth import resolve
from kvfabric.config import AuthConfig
from kvfabric.errors import (
    AuthError,
    ForbiddenError,
    KVFabricError,
    LeaseExpiredError,
    ObjectAbortedError,
    ProtocolError,
    UnavailableError,
    UnsupportedError,
    WouldBlockError,
)
from kvfabric.hashing import ROOT, chunk_keys
from kvfabric.kvevents.blocks import blocks_per_chunk
from kvfabric.kvevents.intents import IntendedChunk
from kvfabric.kvevents.node import MAX_EVENTS_PER_POLL, NamespaceEvents
from kvfabric.protocol.messages import (
    MAX_KEYS,
    MAX_TOKENS,
    PROTOCOL_VERSION,
    Op,
    arg_chain_tokens,
    arg_float,
    arg_head_range,
    arg_int,
    arg_key,
    arg_keys,
    arg_list,
    arg_str,
    arg_tokens,
    item_error,
    item_ok,
)
from kvfabric.readspec import ReadSpec
from kvfabric.server.cluster_link import ClusterLink
from kvfabric.server.instrumented import InstrumentedPuller, InstrumentedPusher
from kvfabric.server.puller import Puller
from kvfabric.server.pusher import Pusher
from kvfabric.server.session import Session
from kvfabric.server.wire_fp8 import FP8, Fp8Wire, checked_wire
from kvfabric.store.handles import ObjectReader, ObjectWriter
from kvfabric.store.protocol import Store

DEFAULT_WAIT_S = 30.0
DEFAULT_PREFETCH_S = 10.0
DEFAULT_PUSH_S = 10.0
# Local reads convert in the consumer, from the pinned pages: the daemon never copies them.
CONVERT_AT_CONSUMER = "consumer"
# Announced in hello: "packed_keys" (a request's keys as one bin of 16-byte keys),
# "read_spec" (a get's ``want``).
FEATURES = ("packed_keys", "read_spec")


@dataclass(frozen=True)
class Context:
    """What handlers may use besides the session."""

    store: Store  # the daemon's InstrumentedStore (tests: a TieredStore)
    auth: AuthConfig
    node_id: str
    max_leases: int
    cluster: ClusterLink | None = None  # None: cluster-scope lookups are refused
    # None: prefetch is refused (no peer transport)
    puller: Puller | InstrumentedPuller | None = None
    pusher: Pusher | InstrumentedPusher | None = None  # None: push is refused (no transport)
    kv_events: NamespaceEvents | None = None  # None: the kv_events op is unsupported
    fp8: Fp8Wire | None = None  # None: chunks move between nodes native only


@dataclass(frozen=True)
class Handler:
    fn: Callable[[Context, Session, dict[str, Any]], Any]
    blocking: bool = False
    local: bool = False
    batch: bool = False  # not run on the loop as a whole: items done before a wait cannot be redone
    waits_for_layers: bool = False  # waits on the loop for commits instead of on a thread
    # a batch of independent items, listed in this argument: tried on the loop after all;
    # the items that would wait (and so did nothing) are redone on a worker thread
    items: str = ""


def hello(ctx: Context, session: Session, args: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    """Authenticate; returns the result and the arena fds to pass (local sessions only).

    A tenant's session gets its tenant's arenas only, the admin's every arena (see
    :mod:`kvfabric.store.tenants`); all are sealed against resizing. ``access: "read"``
    makes a session that only reads: its descriptors are read-only and it may not reserve.
    Each announced arena names its ``arena`` id (what placements name), its tier (``index``,
    ``tier``), ``size``, ``page_size`` and ``writable``."""
    token = args.get("token")
    if token is not None and not isinstance(token, str):
        raise AuthError("token must be a string")
    access = arg_str(args, "access", default="write")
    if access not in ("read", "write"):
        raise ProtocolError(f"access must be 'read' or 'write', got {access!r}")
    session.authenticate(
        _tenant_of(ctx.auth, token), arg_str(args, "client", default=""), read_only=access == "read"
    )
    if not session.local:
        arenas = []
    elif session.tenant is None:
        arenas = ctx.store.arenas()  # the admin (or auth off): every arena
    else:
        arenas = ctx.store.arenas(session.tenant)
    result = {
        "protocol": PROTOCOL_VERSION,
        "node_id": ctx.node_id,
        "tenant": session.tenant,
        "shared_memory": session.local,
        "tiers": ctx.store.tier_names,
        "arenas": [
            {
                "tier": a.tier_name,
                "index": a.tier_index,
                "arena": a.arena_id,
                "size": a.arena.size,
                "page_size": a.arena.page_size,
                "writable": not session.read_only,
            }
            for a in arenas
        ],
        "limits": {"max_keys": MAX_KEYS, "max_tokens": MAX_TOKENS, "max_leases": ctx.max_leases},
        # additions within this protocol version; a client uses them only when listed here
        "features": [*FEATURES, *(["pull"] if ctx.puller is not None else [])],
    }
    return result, [a.read_only_fd if session.read_only else a.arena.fd for a in arenas]


def _tenant_of(auth: AuthConfig, token: str | None) -> str | None:
    principal = resolve(auth, None if token is None else token.encode())
    if principal is None:
        raise AuthError("missing or invalid token")
    return principal.tenant


def lookup(ctx: Context, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    """Local longest prefix; with ``scope: "cluster"`` also ``nodes`` (per node: its epoch,
    hardware class, leading chunks held, and those per tier) and ``stale`` from the global
    index, and ``peer_tokens``: the tokens past the local prefix another node holds (the
    metrics count them as hits from ``peer``, not as misses). ``num_tokens`` (with
    ``keys``): the tokens the chain covers, so a missed partial last chunk counts its real
    tokens."""
    scope = arg_str(args, "scope", default="local")
    if scope not in ("local", "cluster"):
        raise ProtocolError(f"scope must be 'local' or 'cluster', got {scope!r}")
    if scope == "cluster":
        if ctx.cluster is None:
            raise UnsupportedError("this server has no global index")
        if ctx.store.in_nonblocking_mode:
            raise WouldBlockError("a cluster lookup asks the global index over the network")
    ns = session.namespace(args.get("ns"))
    if "keys" in args:
        keys = arg_keys(args)
        num_tokens = arg_chain_tokens(args, len(keys), ns.spec.chunk_tokens)
        if scope == "local":
            return ctx.store.lookup(ns, keys, num_tokens=num_tokens).to_dict()
    else:
        tokens = np.frombuffer(arg_tokens(args), dtype="<i4")
        if scope == "local":
            return ctx.store.lookup_tokens(ns, tokens).to_dict()
        keys, num_tokens = chunk_keys(ns, tokens, include_partial=False), None
    # the global index first: the local lookup counts what other nodes hold as peer hits
    assert ctx.cluster is not None
    nodes, stale = ctx.cluster.node_prefixes(ns, keys)
    peer_chunks = max((n["chunks"] for n in nodes if n["node_id"] != ctx.node_id), default=0)
    result = ctx.store.lookup(ns, keys, num_tokens=num_tokens, peer_chunks=peer_chunks)
    return {**result.to_dict(), "nodes": nodes, "stale": stale, "peer_tokens": result.peer_tokens}


def reserve(ctx: Context, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    _require_writer(session)
    return _reserve_one(ctx, session, session.namespace(args.get("ns")), args)


def reserve_batch(ctx: Context, session: Session, args: dict[str, Any]) -> list[dict[str, Any]]:
    _require_writer(session)
    ns = session.namespace(args.get("ns"))
    return [_item(_reserve_one, ctx, session, ns, item) for item in arg_list(args, "items")]


def _reserve_one(ctx: Context, session: Session, ns: Any, args: Any) -> dict[str, Any]:
    if not isinstance(args, dict):
        raise ProtocolError("a reserve item must be a map")
    parent = arg_key(args, "parent") if "parent" in args else ROOT
    num_tokens = arg_int(
        args, "num_tokens", low=1, high=ns.spec.chunk_tokens, default=ns.spec.chunk_tokens
    )
    heads = arg_head_range(args, ns.spec.num_kv_heads) if "heads" in args else None
    # the store checks that they hash to the key (TokenMismatchError: a bad request)
    tokens = arg_tokens(args) if "tokens" in args else None
    writer = ctx.store.reserve(
        ns, arg_key(args, "key"), parent=parent, num_tokens=num_tokens, heads=heads, tokens=tokens
    )
    return _placement(session.add_lease(writer), writer)


def commit(ctx: Context, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    lease_id = arg_int(args, "lease")
    done = _commit_one(session, lease_id, args.get("layers"))
    if done:
        return {"done": True}
    # a partial commit renewed the lease: the writer may keep writing this much longer
    return {"done": False, "lease_s": _lease_left(session.writer(lease_id))}


def _lease_left(lease: ObjectWriter | ObjectReader) -> float:
    return max(0.0, lease.deadline - time.monotonic())


def _commit_one(session: Session, lease_id: int, layers: Any) -> bool:
    """Commit the layers in mask ``layers`` (all when None); True once the object is
    complete, which ends the lease."""
    writer = session.writer(lease_id)
    try:
        if layers is None:
            writer.commit()
            done = True
        else:
            all_layers = (1 << writer.layout.spec.num_layers) - 1
            done = writer.commit_layers(
                arg_int({"layers": layers}, "layers", low=1, high=all_layers)
            )
    except (LeaseExpiredError, ObjectAbortedError):
        session.forget(lease_id)  # the object is gone: the lease must not count any more
        raise
    if done:
        session.forget(lease_id)
    return done


def commit_batch(ctx: Context, session: Session, args: dict[str, Any]) -> list[dict[str, Any]]:
    """Commit many writers: every layer, or the layers in mask ``layers`` of each (a batch
    of chunks streamed layer by layer costs one round trip per layer)."""
    layers = args.get("layers")
    return [_item(_commit_item, ctx, session, layers, lease) for lease in arg_list(args, "leases")]


def _commit_item(ctx: Context, session: Session, layers: Any, raw_id: Any) -> dict[str, Any]:
    return commit(ctx, session, {"lease": raw_id, "layers": layers})


def abort(ctx: Context, session: Session, args: dict[str, Any]) -> None:
    lease = session.forget(arg_int(args, "lease"))
    if isinstance(lease, ObjectWriter):
        lease.abort()
    else:
        lease.release()


def get(ctx: Context, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    """Pin one chunk. ``want`` (optional: :class:`~kvfabric.readspec.ReadSpec`'s wire form)
    is how the consumer will read it; checked against the namespace before pinning. The
    reply's ``conversions`` name what that read converts (empty: zero copy) and
    ``convert_at`` where it runs (the consumer, straight from the pinned pages)."""
    ns = session.namespace(args.get("ns"))
    return _get_one(
        ctx, session, ns, (args.get("key"), arg_float(args, "timeout"), _conversions(ns, args))
    )


def get_batch(ctx: Context, session: Session, args: dict[str, Any]) -> list[dict[str, Any]]:
    ns = session.namespace(args.get("ns"))
    timeout = arg_float(args, "timeout")
    conversions = _conversions(ns, args)
    return [
        _item(_get_one, ctx, session, ns, (key, timeout, conversions))
        for key in arg_list(args, "keys")
    ]


def _conversions(ns: Any, args: dict[str, Any]) -> list[str]:
    if "want" not in args:
        return []
    want = ReadSpec.from_wire(args["want"])
    want.check(ns.spec)
    return [c.value for c in want.conversions(ns.spec)]


def _get_one(
    ctx: Context, session: Session, ns: Any, item: tuple[Any, float | None, list[str]]
) -> dict[str, Any]:
    key, timeout, conversions = item
    reader = ctx.store.get(ns, arg_key({"key": key}, "key"), timeout=timeout)
    result = _placement(session.add_lease(reader), reader)
    result["ready"] = reader.ready_mask
    if conversions:
        result["conversions"] = conversions
        result["convert_at"] = CONVERT_AT_CONSUMER
    return result


def wait_layer(ctx: Context, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    reader = session.reader(arg_int(args, "lease"))
    reader.wait_layer(
        arg_int(args, "layer", high=reader.layout.spec.num_layers - 1), wait_timeout(args)
    )
    return {"ready": reader.ready_mask}


def wait_timeout(args: dict[str, Any]) -> float:
    return arg_float(args, "timeout") or DEFAULT_WAIT_S


def release(ctx: Context, session: Session, args: dict[str, Any]) -> None:
    _release_one(ctx, session, None, args.get("lease"))


def release_batch(ctx: Context, session: Session, args: dict[str, Any]) -> list[dict[str, Any]]:
    return [_item(_release_one, ctx, session, None, lease) for lease in arg_list(args, "leases")]


def _release_one(ctx: Context, session: Session, _: Any, lease_id: Any) -> None:
    lease = session.forget(arg_int({"lease": lease_id}, "lease"))
    if lease.expired:
        # the pages may have been reused while the client read them: tell it so
        raise LeaseExpiredError(
            f"the pin on {lease.key.hex()} expired before its release; "
            f"data read through it may be torn"
        )
    if isinstance(lease, ObjectReader):
        lease.release()
    else:
        lease.abort()


def contains(ctx: Context, session: Session, args: dict[str, Any]) -> list[bool]:
    ns = session.namespace(args.get("ns"))
    return [ctx.store.contains(ns, key) for key in arg_keys(args)]


def delete(ctx: Context, session: Session, args: dict[str, Any]) -> bool:
    ns = session.namespace(args.get("ns"))
    return bool(ctx.store.delete(ns, arg_key(args, "key")))


def kv_events(ctx: Context, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    """A namespace's changes as vLLM events (:mod:`kvfabric.kvevents.node`); a tenant reads
    only its own namespaces (``session.namespace``)."""
    if ctx.kv_events is None:
        raise UnsupportedError("this daemon keeps no change log")
    ns = session.namespace(args.get("ns"))
    block_size = arg_int(args, "block_size", low=1, high=ns.spec.chunk_tokens)
    try:
        blocks_per_chunk(ns.spec.chunk_tokens, block_size)
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None
    after = arg_int(args, "after", low=-1)
    limit = arg_int(args, "max", low=1, high=MAX_EVENTS_PER_POLL, default=MAX_EVENTS_PER_POLL)
    return ctx.kv_events.poll(ns, after, block_size, limit)


def intend(ctx: Context, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    """Announce chunks the caller's engine is about to compute, so that routers hear of them
    before their reservation (:mod:`kvfabric.kvevents.intents`). ``items``: ``key``,
    ``parent``?, ``num_tokens``?, ``tokens`` (their own token ids, which must hash to the key:
    otherwise ``bad_request``, nothing announced). Returns ``announced`` (chunks not held
    here nor announced already)."""
    _require_writer(session)
    if ctx.kv_events is None or ctx.kv_events.intents is None:
        raise UnsupportedError("this daemon announces no writes ahead (kv_events is off)")
    ns = session.namespace(args.get("ns"))
    chunks = [_intended(ns, item) for item in arg_list(args, "items")]
    return {"announced": ctx.kv_events.intents.announce(ns, chunks)}


def _intended(ns: Any, item: Any) -> IntendedChunk:
    if not isinstance(item, dict):
        raise ProtocolError("an intend item must be a map")
    return IntendedChunk(
        arg_key(item, "key"),
        arg_key(item, "parent") if "parent" in item else ROOT,
        arg_int(item, "num_tokens", low=1, high=ns.spec.chunk_tokens, default=ns.spec.chunk_tokens),
        arg_tokens(item),
    )


def stats(ctx: Context, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    if session.tenant is not None:
        raise ForbiddenError("node statistics need the admin token")
    return dataclasses.asdict(ctx.store.stats())


def ping(ctx: Context, session: Session, args: dict[str, Any]) -> str:
    return "pong"


def peer_pin(ctx: Context, session: Session, args: dict[str, Any]) -> list[dict[str, Any]]:
    """Pin chunks for a peer node that reads them over its transport (admin only).

    Per key: the pin's placement (see :func:`_placement`) plus ``page_size`` (of the tier the
    pages are in), ``parent`` and, when the chunk has them, its ``tokens``, or that key's
    error. SSD copies are read back into memory
    first; a chunk still being written is waited for until ``timeout``. The pins are leases
    of this session: given back by ``peer_release``, when the session ends, or at their
    deadline. ``wire: "fp8"``: each chunk this node can encode is also staged as fp8
    (:mod:`kvfabric.server.wire_fp8`), named in its item's ``staging`` with its checksum.
    """
    _require_admin(session, "peer_pin")
    ns = session.namespace(args.get("ns"))
    timeout = arg_float(args, "timeout")
    wire = checked_wire(args.get("wire"))
    page_sizes = {index: arena.page_size for index, _, arena in ctx.store.host_arenas()}
    encode = wire == FP8 and ctx.fp8 is not None
    return [
        _item(_peer_pin_one, ctx, session, ns, (key, timeout, page_sizes, encode))
        for key in arg_keys(args)
    ]


def _peer_pin_one(
    ctx: Context, session: Session, ns: Any, item: tuple[bytes, float | None, dict[int, int], bool]
) -> dict[str, Any]:
    key, timeout, page_sizes, encode = item
    reader = ctx.store.get(ns, key, timeout=timeout)
    try:
        reader.wait_complete(timeout or DEFAULT_WAIT_S)  # a peer copies whole chunks only
        result = _placement(session.add_lease(reader), reader)
    except BaseException:
        if not reader.closed:
            reader.release()
        raise
    page_size = None if reader.arena_id is None else page_sizes.get(reader.arena_id)
    if page_size is None:  # a device tier: the peer's transport cannot reach it
        _release_one(ctx, session, None, result["lease"])
        raise UnavailableError("the chunk is in a tier peers cannot read from")
    result.update(page_size=page_size, parent=reader.parent)
    if reader.tokens is not None:
        result["tokens"] = reader.tokens
    if encode and ctx.fp8 is not None:
        staging = ctx.fp8.outbound.stage(reader)
        if staging is not None:
            result["staging"] = staging
    return result


def peer_release(ctx: Context, session: Session, args: dict[str, Any]) -> list[dict[str, Any]]:
    """Give back pins taken by ``peer_pin`` (admin only); per lease: ok or its error."""
    _require_admin(session, "peer_release")
    if ctx.fp8 is not None:
        for lease in arg_list(args, "leases"):
            try:
                ctx.fp8.outbound.done(session.reader(arg_int({"lease": lease}, "lease")))
            except KVFabricError:
                pass  # not a pin of this session: release_batch reports it
    return release_batch(ctx, session, args)


def peer_reserve(ctx: Context, session: Session, args: dict[str, Any]) -> list[dict[str, Any]]:
    """Reserve chunks a peer node is about to push (admin only).

    ``items`` as for ``reserve_batch``; per item: the reservation's placement (see
    :func:`_placement`) plus ``page_size`` (of the tier the pages are in), or that item's
    error (``exists`` when the chunk is stored or being written here already). From now on
    local readers find the chunks and may wait on their layers. The reservations are leases
    of this session: committed layer by layer with ``peer_commit``, dropped by
    ``peer_abort``, when the session ends (the pusher died), or at their deadline.
    """
    _require_admin(session, "peer_reserve")
    ns = session.namespace(args.get("ns"))
    page_sizes = {index: arena.page_size for index, _, arena in ctx.store.host_arenas()}
    return [
        _item(_peer_reserve_one, ctx, session, ns, (item, page_sizes))
        for item in arg_list(args, "items")
    ]


def _peer_reserve_one(
    ctx: Context, session: Session, ns: Any, item: tuple[Any, dict[int, int]]
) -> dict[str, Any]:
    raw, page_sizes = item
    wire = checked_wire(raw.get("wire") if isinstance(raw, dict) else None)
    result = _reserve_one(ctx, session, ns, raw)
    arena = result.get("arena")
    page_size = None if arena is None else page_sizes.get(arena)
    if page_size is None:  # a device tier: the peer's transport cannot reach it
        _abort_one(ctx, session, None, result["lease"])
        raise UnavailableError("the chunk was placed in a tier peers cannot write to")
    result["page_size"] = page_size
    if wire == FP8 and ctx.fp8 is not None:
        staging = ctx.fp8.inbound.take(session.writer(result["lease"]))
        if staging is not None:
            result["staging"] = staging
    return result


def peer_commit(ctx: Context, session: Session, args: dict[str, Any]) -> list[dict[str, Any]]:
    """Commit the layers in mask ``layers`` of every reservation in ``leases`` (taken by
    ``peer_reserve``; admin only): local readers waiting on them wake up. Per lease:
    ``{"done"}`` (True once the chunk is complete, which ends the lease) or its error."""
    _require_admin(session, "peer_commit")
    layers = arg_int(args, "layers", low=1)
    leases = arg_list(args, "leases")
    checksums = args.get("checksums") or [None] * len(leases)
    if not isinstance(checksums, list) or len(checksums) != len(leases):
        raise ProtocolError("checksums: one entry (or null) per lease")
    return [
        _item(_peer_commit_one, ctx, session, None, (lease, layers, checksum))
        for lease, checksum in zip(leases, checksums)
    ]


def _peer_commit_one(
    ctx: Context, session: Session, _: Any, item: tuple[Any, int, Any]
) -> dict[str, bool]:
    raw_id, layers, checksum = item
    lease_id = arg_int({"lease": raw_id}, "lease")
    inbound = None if ctx.fp8 is None else ctx.fp8.inbound
    writer = session.writer(lease_id)
    if inbound is None or not inbound.receives(writer):
        return {"done": _commit_one(session, lease_id, layers)}
    if ctx.store.in_nonblocking_mode:  # decoding takes a while: not on the event loop
        raise WouldBlockError("fp8 layers are decoded on a worker thread")
    try:
        inbound.land(writer, layers, checksum)
        done = _commit_one(session, lease_id, layers)
    except BaseException:
        _abort_one(ctx, session, None, lease_id)  # a damaged chunk is never readable
        raise
    if done:
        inbound.done(writer)
    return {"done": done}


def peer_abort(ctx: Context, session: Session, args: dict[str, Any]) -> list[dict[str, Any]]:
    """Drop reservations taken by ``peer_reserve`` (admin only); per lease: ok or its
    error. Readers waiting on the chunks get an error."""
    _require_admin(session, "peer_abort")
    return [_item(_abort_one, ctx, session, None, lease) for lease in arg_list(args, "leases")]


def _abort_one(ctx: Context, session: Session, _: Any, raw_id: Any) -> None:
    lease_id = arg_int({"lease": raw_id}, "lease")
    writer = session.writer(lease_id)  # a pin is not this op's to drop
    session.forget(lease_id)
    writer.abort()
    if ctx.fp8 is not None:
        ctx.fp8.inbound.done(writer)


def push(ctx: Context, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    """Push the chunks of ``keys`` to node ``target`` layer by layer, as their layers are
    committed here, within ``timeout`` seconds (see :mod:`kvfabric.server.pusher`).

    Returns counts of distinct chunks: ``pushed``, ``already_there``, ``failed``.
    """
    if ctx.pusher is None:
        raise UnsupportedError(
            "this node cannot push chunks: it has no peer transport (cluster.index is not redis)"
        )
    ns = session.namespace(args.get("ns"))
    keys = arg_keys(args)
    target = arg_str(args, "target")
    timeout = arg_float(args, "timeout") or DEFAULT_PUSH_S
    wire = args.get("wire")
    if wire is not None:
        checked_wire(wire)  # None: as the node's configuration says
    return ctx.pusher.push(ns, keys, target, timeout, wire=wire).to_dict()


def prefetch(ctx: Context, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    """Pull the chunks of ``keys`` (or of the full chunks of ``tokens``) this node lacks from
    the nodes that own them, within ``timeout`` seconds (see :mod:`kvfabric.server.puller`).

    Returns ``pulled``, ``already_local``, ``missing`` (counts of chunks) and ``source`` (the
    node the pulled chunks came from, or None).
    """
    if ctx.puller is None:
        raise UnsupportedError(
            "this node cannot pull chunks: it has no peer transport (cluster.index is not redis)"
        )
    ns = session.namespace(args.get("ns"))
    if "keys" in args:
        keys = arg_keys(args)
    else:
        keys = chunk_keys(ns, np.frombuffer(arg_tokens(args), dtype="<i4"), include_partial=False)
    timeout = arg_float(args, "timeout") or DEFAULT_PREFETCH_S
    return ctx.puller.prefetch(ns, keys, timeout).to_dict()


def _require_writer(session: Session) -> None:
    if session.read_only:
        raise ForbiddenError("this session said in hello that it only reads")


def _require_admin(session: Session, op: str) -> None:
    # a tenant token must not pin (or read, through a transport) another node's pages
    if session.tenant is not None:
        raise ForbiddenError(f"{op} is a node-to-node operation: it needs the admin token")


def _item(
    fn: Callable[[Context, Session, Any, Any], Any],
    ctx: Context,
    session: Session,
    ns: Any,
    item: Any,
) -> dict[str, Any]:
    """One batch item: its result, or its own error (the other items go on)."""
    try:
        return item_ok(fn(ctx, session, ns, item))
    except KVFabricError as exc:
        return item_error(exc)


def _placement(lease_id: int, lease: ObjectWriter | ObjectReader) -> dict[str, Any]:
    # lease_s: the client stops touching the pages when it runs out, since after it they
    # may belong to another object (a client frozen mid-copy is the one case it cannot stop)
    # arena: the shared-memory arena the pages lie in (absent: not one a client can map)
    result = {
        "lease": lease_id,
        "tier": lease.tier_index,
        "pages": lease.pages.tobytes(),
        "nbytes": lease.nbytes,
        "num_tokens": lease.num_tokens,
        "lease_s": _lease_left(lease),
    }
    arena = lease.arena_id
    if arena is not None:
        result["arena"] = arena
    return result


HANDLERS: dict[Op, Handler] = {
    # blocking: a cluster lookup goes to a worker thread (local ones still run on the loop)
    Op.LOOKUP: Handler(lookup, blocking=True),
    Op.RESERVE: Handler(reserve, blocking=True, local=True),
    Op.COMMIT: Handler(commit, local=True),
    Op.ABORT: Handler(abort, local=True),
    Op.GET: Handler(get, blocking=True, local=True),
    Op.WAIT_LAYER: Handler(wait_layer, blocking=True, local=True, waits_for_layers=True),
    Op.RELEASE: Handler(release, local=True),
    Op.RESERVE_BATCH: Handler(reserve_batch, blocking=True, local=True, batch=True, items="items"),
    Op.COMMIT_BATCH: Handler(commit_batch, local=True),
    Op.GET_BATCH: Handler(get_batch, blocking=True, local=True, batch=True, items="keys"),
    Op.RELEASE_BATCH: Handler(release_batch, local=True),
    Op.CONTAINS: Handler(contains),
    Op.DELETE: Handler(delete),
    Op.STATS: Handler(stats),
    Op.PING: Handler(ping),
    # blocking: a first poll reads the whole inventory (a snapshot)
    Op.KV_EVENTS: Handler(kv_events, blocking=True),
    Op.INTEND: Handler(intend),
    # node to node, over TCP: batch so it never runs on the loop (it may read SSD, wait)
    Op.PEER_PIN: Handler(peer_pin, blocking=True, batch=True),
    Op.PEER_RELEASE: Handler(peer_release),
    # local: it fills this node's memory; batch: network I/O belongs on a worker thread
    Op.PREFETCH: Handler(prefetch, blocking=True, local=True, batch=True),
    # a reservation may wait for room; commits and aborts only take the store lock
    Op.PEER_RESERVE: Handler(peer_reserve, blocking=True, batch=True),
    # batch: an fp8 chunk's commit decodes it, on a worker thread (tried on the loop first)
    Op.PEER_COMMIT: Handler(peer_commit, blocking=True, batch=True, items="leases"),
    Op.PEER_ABORT: Handler(peer_abort),
    # local, batch: as prefetch (it also waits for this node's layers)
    Op.PUSH: Handler(push, blocking=True, local=True, batch=True),
}
