"""Arguments of each request and parsing of their results (the client, and the daemon's
puller and pusher for batch results)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvfabric.errors import SpecError, UnavailableError, error_for_kind
from kvfabric.hashing import ROOT, ChunkRef, ChunkTokens, as_token_array, token_bytes
from kvfabric.lookup import LookupResult
from kvfabric.payload import HeadRange
from kvfabric.protocol.messages import encode_namespace, pack_keys
from kvfabric.readspec import ReadSpec
from kvfabric.spec import Namespace


def lookup_args(
    ns: Namespace,
    tokens: Any = None,
    keys: Sequence[bytes] | None = None,
    scope: str = "local",
    *,
    packed: bool = False,
    num_tokens: int | None = None,
) -> dict[str, Any]:
    """Either token ids (hashed by the daemon, full chunks only) or chunk keys (one packed
    bin when the daemon announced "packed_keys", else a list); ``num_tokens`` (keys only):
    the tokens the chain covers, its last chunk may be partial."""
    if (tokens is None) == (keys is None):
        raise SpecError("lookup takes either tokens or keys")
    if num_tokens is not None and keys is None:
        raise SpecError("num_tokens goes with keys (token ids say it themselves)")
    args: dict[str, Any] = {"ns": encode_namespace(ns)}
    if scope != "local":
        args["scope"] = scope
    if keys is not None:
        args["keys"] = pack_keys(keys) if packed else list(keys)
        if num_tokens is not None:
            args["num_tokens"] = num_tokens
    else:
        args["tokens"] = as_token_array(tokens).astype("<i4").tobytes()
    return args


def prefetch_args(
    ns: Namespace,
    tokens: Any,
    keys: Sequence[bytes] | None,
    timeout: float,
    *,
    packed: bool = False,
) -> dict[str, Any]:
    return {**lookup_args(ns, tokens, keys, packed=packed), "timeout": timeout}


def packs_keys(hello: dict[str, Any]) -> bool:
    """Whether the daemon that answered ``hello`` takes packed keys (older ones do not)."""
    return "packed_keys" in (hello.get("features") or ())


def push_args(
    ns: Namespace, keys: Sequence[bytes], target: str, timeout: float, wire: str | None = None
) -> dict[str, Any]:
    args = {**keys_args(ns, keys), "target": target, "timeout": timeout}
    if wire is not None:
        args["wire"] = wire
    return args


def lookup_result(result: dict[str, Any]) -> LookupResult:
    return LookupResult.from_dict(result)


def reserve_args(
    ns: Namespace,
    key: bytes,
    parent: bytes = ROOT,
    num_tokens: int | None = None,
    heads: HeadRange | None = None,
    tokens: ChunkTokens | None = None,
) -> dict[str, Any]:
    return {"ns": encode_namespace(ns), **_reserve_item(key, parent, num_tokens, heads, tokens)}


def reserve_batch_args(
    ns: Namespace,
    chunks: Sequence[ChunkRef],
    heads: HeadRange | None = None,
    tokens: Sequence[ChunkTokens | None] | None = None,
) -> dict[str, Any]:
    """``tokens``: each chunk's own token ids (None where not given), in chunk order."""
    if tokens is not None and len(tokens) != len(chunks):
        raise ValueError("tokens: one entry per chunk")
    per_chunk = [None] * len(chunks) if tokens is None else tokens
    return {
        "ns": encode_namespace(ns),
        "items": [
            _reserve_item(c.key, c.parent, c.num_tokens, heads, t)
            for c, t in zip(chunks, per_chunk)
        ],
    }


def _reserve_item(
    key: bytes,
    parent: bytes,
    num_tokens: int | None,
    heads: HeadRange | None,
    tokens: ChunkTokens | None,
) -> dict[str, Any]:
    item: dict[str, Any] = {"key": key, "parent": parent}
    if num_tokens is not None:
        item["num_tokens"] = num_tokens
    if heads is not None:  # one tensor-parallel rank's KV heads
        item["heads"] = list(heads)
    if tokens is not None:  # the daemon checks that they hash to the key
        item["tokens"] = token_bytes(tokens)
    return item


def get_batch_args(
    ns: Namespace, keys: Sequence[bytes], timeout: float | None, want: ReadSpec | None = None
) -> dict[str, Any]:
    args: dict[str, Any] = {"ns": encode_namespace(ns), "keys": list(keys)}
    return _read_options(args, ns, timeout, want)


def item_results(items: list[dict[str, Any]]) -> list[Any]:
    """Per-item results of a batch: the result, or the rebuilt exception (not raised)."""
    out: list[Any] = []
    for item in items:
        if item.get("ok") is True:
            out.append(item.get("result"))
        else:
            error = item.get("error") or {}
            out.append(error_for_kind(str(error.get("kind")), str(error.get("message"))))
    return out


def get_args(
    ns: Namespace, key: bytes, timeout: float | None, want: ReadSpec | None = None
) -> dict[str, Any]:
    return _read_options({"ns": encode_namespace(ns), "key": key}, ns, timeout, want)


def _read_options(
    args: dict[str, Any], ns: Namespace, timeout: float | None, want: ReadSpec | None
) -> dict[str, Any]:
    if timeout is not None:
        args["timeout"] = timeout
    if want is not None:  # checked here too: a bad spec never costs a round trip
        if not isinstance(want, ReadSpec):
            raise TypeError(f"want must be a ReadSpec, got {type(want).__name__}")
        want.check(ns.spec)
        args["want"] = want.to_wire()
    return args


def keys_args(ns: Namespace, keys: Sequence[bytes], *, packed: bool = False) -> dict[str, Any]:
    """``packed``: one bin of keys (a daemon that announced "packed_keys" decodes it in
    well under a millisecond; a list of 65,536 keys costs it ~8 ms)."""
    return {"ns": encode_namespace(ns), "keys": pack_keys(keys) if packed else list(keys)}


def key_args(ns: Namespace, key: bytes) -> dict[str, Any]:
    return {"ns": encode_namespace(ns), "key": key}


def lease_session(leases: Sequence[Any]) -> Any:
    """The one live session a batch of lease handles lives on."""
    session = leases[0]._session
    if any(lease._session is not session for lease in leases) or session.closed:
        raise UnavailableError("leases of a lost or different session")
    return session


def leases_args(leases: Sequence[Any]) -> dict[str, Any]:
    """Arguments of a commit / release batch; the handles count as given back from now."""
    args = {"leases": [lease.lease for lease in leases]}
    for lease in leases:
        lease.closed = True
    return args


def layer_commit_args(writers: Sequence[Any], layer: int) -> dict[str, Any]:
    for writer in writers:
        writer.layout.layer_range(layer)  # validate before asking
    return {"leases": [writer.lease for writer in writers], "layers": 1 << layer}


def raise_first(results: Sequence[Any]) -> None:
    for result in results:
        if isinstance(result, BaseException):
            raise result
