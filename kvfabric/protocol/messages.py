"""Control-protocol messages: envelopes, operations, and validation of every argument.

Request ``{"v": 1, "id": <u64>, "op": <str>, "args": {...}}``; reply
``{"v": 1, "id": <same>, "ok": true, "result": ...}`` or
``{"v": 1, "id": <same>, "ok": false, "error": {"kind": <str>, "message": <str>}}``.
Error kinds are :attr:`kvfabric.errors.KVFabricError.kind` values; clients rebuild the
exception with :func:`kvfabric.errors.error_for_kind`.

Operations (a session must start with ``hello``): every one, with every field its handler
reads, is in :mod:`kvfabric.protocol.ops`, the table ``docs/protocol.md`` is generated from.

Batch operations amortise one round trip over many chunks (an engine saves or loads many per
step); each item succeeds or fails on its own: ``{"ok": true, "result": ...}`` or
``{"ok": false, "error": {"kind", "message"}}``, in request order.

``ns`` is ``{"model", "spec": KVSpec fields, "tenant", "lora"}``; keys are 16-byte bins, and
``keys`` is a list of them or, packed, one bin of them back to back (a 512-chunk lookup is then
one object to encode and decode instead of 512; daemons accept both forms);
``pages`` is a bin of little-endian uint32 page ids in the arena of tier ``tier``. A lookup's
``num_tokens`` (with ``keys``; daemons that predate it ignore it) is the tokens the chain
covers, so a missed partial last chunk counts its real tokens in ``requested_tokens`` and the
metrics; a cluster-scope lookup's ``peer_tokens`` are the tokens past this node's prefix that
another node holds (hits from ``peer`` in the metrics). Every validator here raises
:class:`~kvfabric.errors.ProtocolError` with the offending field.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvfabric import hashing
from kvfabric.errors import KVFabricError, ProtocolError, SpecError, UnsupportedVersionError
from kvfabric.hashing import KEY_BYTES
from kvfabric.spec import KVSpec, Namespace

PROTOCOL_VERSION = 1
MAX_KEYS = 1 << 16  # chunks per lookup / contains (16M tokens at 256 per chunk)
MAX_TOKENS = 1 << 22
MAX_TIMEOUT_S = 600.0
MAX_BATCH = 1024  # items per batch request
MAX_STRING = 4096
_PACKED_KEY = np.dtype(f"V{KEY_BYTES}")  # raw bytes: unlike "S16", trailing zeros are kept
_BYTES_TYPE = {bytes}
_KEY_LENGTH = {KEY_BYTES}


class Op(str, enum.Enum):
    HELLO = "hello"
    LOOKUP = "lookup"
    RESERVE = "reserve"
    COMMIT = "commit"
    ABORT = "abort"
    GET = "get"
    WAIT_LAYER = "wait_layer"
    RELEASE = "release"
    RESERVE_BATCH = "reserve_batch"
    COMMIT_BATCH = "commit_batch"
    GET_BATCH = "get_batch"
    RELEASE_BATCH = "release_batch"
    CONTAINS = "contains"
    DELETE = "delete"
    STATS = "stats"
    PING = "ping"
    PEER_PIN = "peer_pin"  # node to node (TCP): pin chunks a peer is about to read
    PEER_RELEASE = "peer_release"
    PREFETCH = "prefetch"  # pull chunks this node lacks from their owners
    PEER_RESERVE = "peer_reserve"  # node to node (TCP): reserve chunks a peer will push
    PEER_COMMIT = "peer_commit"
    PEER_ABORT = "peer_abort"
    PUSH = "push"  # push chunks to a peer, layer by layer as they are committed
    KV_EVENTS = "kv_events"  # a namespace's inventory changes as vLLM KV events
    INTEND = "intend"  # announce chunks an engine is about to compute (KV events)


def request(request_id: int, op: Op, args: dict[str, Any]) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": request_id, "op": op.value, "args": args}


def ok_reply(request_id: int, result: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": request_id, "ok": True, "result": result}


def error_reply(request_id: int, error: KVFabricError) -> dict[str, Any]:
    return {
        "v": PROTOCOL_VERSION,
        "id": request_id,
        "ok": False,
        "error": {"kind": error.kind, "message": str(error)[:MAX_STRING]},
    }


def item_ok(result: Any) -> dict[str, Any]:
    return {"ok": True, "result": result}


def item_error(error: KVFabricError) -> dict[str, Any]:
    return {"ok": False, "error": {"kind": error.kind, "message": str(error)[:MAX_STRING]}}


def parse_request(message: dict[str, Any]) -> tuple[int, Op, dict[str, Any]]:
    """Envelope of a request -> (id, op, args). The id is returned even if the rest is bad."""
    request_id = message.get("id")
    if (
        not isinstance(request_id, int)
        or isinstance(request_id, bool)
        or not 0 <= request_id < 1 << 64
    ):
        raise ProtocolError("request id must be an unsigned 64-bit integer")
    version = message.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:  # True == 1 is not a version
        raise UnsupportedVersionError(
            f"protocol version {version!r} is not supported (this daemon speaks {PROTOCOL_VERSION})"
        )
    try:
        op = Op(message.get("op"))
    except (ValueError, TypeError):
        raise ProtocolError(f"unknown op {message.get('op')!r}") from None
    args = message.get("args", {})
    if not isinstance(args, dict):
        raise ProtocolError("args must be a map")
    return request_id, op, args


def request_id_of(message: Any) -> int:
    """Best-effort id of a (possibly malformed) request, for the error reply."""
    if isinstance(message, dict):
        rid = message.get("id")
        if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < 1 << 64:
            return rid
    return 0


# ---------------------------------------------------------------------- argument validation


def arg_int(
    args: dict[str, Any],
    name: str,
    *,
    low: int = 0,
    high: int = (1 << 63) - 1,
    default: int | None = None,
) -> int:
    value = args.get(name, default)
    if value is None:
        raise ProtocolError(f"missing argument {name!r}")
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ProtocolError(f"{name} must be an integer in [{low}, {high}]")
    return value


def arg_chain_tokens(args: dict[str, Any], num_keys: int, chunk_tokens: int) -> int | None:
    """``num_tokens`` of a lookup by keys: the tokens the chain covers (its last chunk may
    be partial); None when absent (every chunk counts as full)."""
    if args.get("num_tokens") is None:
        return None
    low = (num_keys - 1) * chunk_tokens + 1 if num_keys else 0
    return arg_int(args, "num_tokens", low=low, high=num_keys * chunk_tokens)


def arg_head_range(args: dict[str, Any], num_heads: int) -> tuple[int, int]:
    """``heads``: [start, end) of KV heads (one tensor-parallel rank's range)."""
    value = args.get("heads")
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ProtocolError("heads must be a [start, end) pair")
    start = arg_int({"start": value[0]}, "start", high=num_heads - 1)
    end = arg_int({"end": value[1]}, "end", low=start + 1, high=num_heads)
    return start, end


def arg_float(
    args: dict[str, Any], name: str, *, default: float | None = None, high: float = MAX_TIMEOUT_S
) -> float | None:
    value = args.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= high:
        raise ProtocolError(f"{name} must be a number in [0, {high}]")
    return float(value)


def arg_str(args: dict[str, Any], name: str, *, default: str | None = None) -> str:
    value = args.get(name, default)
    if not isinstance(value, str) or len(value) > MAX_STRING:
        raise ProtocolError(f"{name} must be a string of at most {MAX_STRING} characters")
    return value


def arg_key(args: dict[str, Any], name: str) -> bytes:
    value = args.get(name)
    if not isinstance(value, bytes) or len(value) != KEY_BYTES:
        raise ProtocolError(f"{name} must be {KEY_BYTES} bytes")
    return value


def arg_list(args: dict[str, Any], name: str, limit: int = MAX_BATCH) -> list[Any]:
    value = args.get(name)
    if not isinstance(value, list) or not value or len(value) > limit:
        raise ProtocolError(f"{name} must be a non-empty list of at most {limit} entries")
    return value


def arg_keys(args: dict[str, Any], name: str = "keys") -> list[bytes]:
    """A list of 16-byte keys, or one bin of them back to back (its size is checked before
    it is cut into keys)."""
    value = args.get(name)
    if type(value) is bytes:
        if len(value) % KEY_BYTES or len(value) > MAX_KEYS * KEY_BYTES:
            raise ProtocolError(
                f"packed {name} must be whole {KEY_BYTES}-byte keys, at most {MAX_KEYS}"
            )
        keys: list[bytes] = np.frombuffer(value, dtype=_PACKED_KEY).tolist()
        return keys
    if not isinstance(value, list) or len(value) > MAX_KEYS:
        raise ProtocolError(f"{name} must be a list of at most {MAX_KEYS} keys")
    # two passes in C instead of a type and a length check per key in Python
    if not (set(map(type, value)) <= _BYTES_TYPE and set(map(len, value)) <= _KEY_LENGTH):
        raise ProtocolError(f"every entry of {name} must be {KEY_BYTES} bytes")
    return value


def pack_keys(keys: Sequence[bytes]) -> bytes:
    """The packed form of ``keys`` (each must be :data:`KEY_BYTES` bytes)."""
    join = hashing.join_keys
    if join is not None and type(keys) in (list, tuple):
        try:
            return join(keys, KEY_BYTES)
        except (TypeError, ValueError):
            pass  # bytes-like keys, or wrong ones: the path below takes or names them
    try:
        packed = b"".join(keys)
    except TypeError:
        packed = b""  # not bytes: refused below
    if len(packed) != KEY_BYTES * len(keys) or not set(map(len, keys)) <= _KEY_LENGTH:
        raise SpecError(f"every key must be {KEY_BYTES} bytes")
    return packed


def arg_tokens(args: dict[str, Any], name: str = "tokens") -> bytes:
    """Token ids as a bin of int32-LE (compact and hashable without conversion)."""
    value = args.get(name)
    if not isinstance(value, bytes) or len(value) % 4 or len(value) > 4 * MAX_TOKENS:
        raise ProtocolError(f"{name} must be int32-LE bytes of at most {MAX_TOKENS} tokens")
    return value


def encode_namespace(ns: Namespace) -> dict[str, Any]:
    return {
        "model": ns.model_id,
        "spec": ns.spec.to_dict(),
        "tenant": ns.tenant_salt,
        "lora": ns.lora_id,
    }


def decode_namespace(value: Any) -> Namespace:
    if (
        not isinstance(value, dict)
        or not all(isinstance(k, str) for k in value)
        or set(value) - {"model", "spec", "tenant", "lora"}
    ):
        raise ProtocolError("ns must be a map with model, spec, tenant, lora")
    spec = value.get("spec")
    if not isinstance(spec, dict) or not all(isinstance(k, str) for k in spec):
        raise ProtocolError("ns.spec must be a map of KVSpec fields")
    try:
        return Namespace(
            arg_str(value, "model"),
            KVSpec.from_dict(spec),
            arg_str(value, "tenant", default=""),
            arg_str(value, "lora", default=""),
        )
    except SpecError as exc:
        raise ProtocolError(f"bad namespace: {exc}") from None
