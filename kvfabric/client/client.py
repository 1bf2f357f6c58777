"""The blocking client every connector uses to talk to its node's daemon.

>>> with Client("/var/lib/kvfabric/kvfabric.sock") as client:
...     hit = client.lookup(ns, tokens=prompt)              # matched tokens, per tier
...     with client.reserve(ns, key, parent=parent) as w:    # pages in shared memory
...         for layer in range(spec.num_layers):
...             w.write_layer(layer, kv[layer])              # or fill w.layer_pieces(layer)
...             w.commit_layer(layer)                        # readers may start now
...     with client.get(ns, key) as r:                       # pinned until released
...         r.wait_layer(0)
...         views = r.layer_pieces(0)                        # zero copy

Reconnects: when the daemon goes away (restart), requests that are safe to repeat
(lookup, contains, get, reserve, put, delete, stats, ping) reconnect with backoff and retry
until ``reconnect_timeout``; leases taken on the old session are gone and their handles
raise :class:`~kvfabric.errors.UnavailableError`. Connecting (here and on each reconnect)
retries a busy daemon (full accept queue, at ``max_sessions``, a flood pushing connections
out) within ``timeout`` and fails fast when none is listening
(:mod:`kvfabric.client.connection`); every failure is a
:class:`~kvfabric.errors.KVFabricError`. Thread-safe: requests are serialised on one
connection (use one client per thread for parallelism).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvfabric.client import pipelined_put, requests
from kvfabric.client.connection import Address, Connection
from kvfabric.client.objects import RemoteReader, RemoteWriter
from kvfabric.client.retry import Backoff, ExponentialBackoff
from kvfabric.client.tls import TLSOption
from kvfabric.errors import KVFabricError, NotFoundError, UnavailableError
from kvfabric.hashing import ROOT, ChunkRef, ChunkTokens
from kvfabric.lookup import LookupResult
from kvfabric.payload import HeadRange, put_whole
from kvfabric.protocol.messages import Op, encode_namespace
from kvfabric.readspec import ReadSpec
from kvfabric.spec import Namespace

DEFAULT_SOCKET = "./kvfabric-data/kvfabric.sock"
DEFAULT_PREFETCH_S = 10.0
DEFAULT_PUSH_S = 10.0
# The daemon answers a prefetch or a push by its deadline; this much more covers the trip.
PREFETCH_REPLY_MARGIN_S = 5.0


def default_address() -> str:
    return os.environ.get("KVFABRIC_SOCKET_PATH", DEFAULT_SOCKET)


class Client:
    """A session with the local daemon (Unix socket) or a remote one (TCP: no leases)."""

    def __init__(
        self,
        address: Address | None = None,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        reconnect: bool = True,
        reconnect_timeout: float = 30.0,
        backoff: Backoff | None = None,
        engine: str | None = None,
        tls: TLSOption = None,
    ) -> None:
        """``engine`` names what this client serves ("vllm", "sglang", ...): the daemon's
        per-engine traffic metrics carry it as a label. ``tls`` (a
        :class:`~kvfabric.client.tls.ClientTLS` or an ``ssl.SSLContext``): speak TLS to a TCP
        address (a daemon with ``security.tls_planes`` including ``tcp``)."""
        self.address = address if address is not None else default_address()
        self._token = token if token is not None else os.environ.get("KVFABRIC_TOKEN")
        self.timeout = timeout
        self.reconnect = reconnect
        self.reconnect_timeout = reconnect_timeout
        self.engine = engine
        self._tls = tls
        self._backoff = backoff or ExponentialBackoff()
        self._lock = threading.Lock()
        self._connection: Connection | None = Connection(
            self.address,
            token=self._token,
            timeout=timeout,
            client=engine,
            backoff=self._backoff,
            tls=tls,
        )

    @property
    def node_id(self) -> str:
        return str(self._session().hello["node_id"])

    @property
    def can_pull(self) -> bool:
        """Whether the daemon can pull chunks other nodes hold (:meth:`prefetch`): it is in a
        cluster with a peer transport (its hello lists the ``pull`` feature)."""
        return "pull" in (self._session().hello.get("features") or ())

    def lookup(
        self,
        ns: Namespace,
        tokens: Any = None,
        *,
        keys: Sequence[bytes] | None = None,
        scope: str = "local",
        num_tokens: int | None = None,
    ) -> LookupResult:
        """Longest prefix the node holds, from token ids (full chunks) or chunk keys; with
        ``scope="cluster"`` also the longest any live node holds (``cluster_chunks``).
        ``num_tokens`` (with keys): the tokens the chain covers, when its last chunk may be
        partial, so the daemon's metrics count a missed partial chunk by its real tokens."""
        return requests.lookup_result(
            self._call(
                Op.LOOKUP,
                requests.lookup_args(
                    ns, tokens, keys, scope, packed=self._packs_keys(), num_tokens=num_tokens
                ),
            )
        )

    def prefetch(
        self,
        ns: Namespace,
        keys: Sequence[bytes] | None = None,
        tokens: Any = None,
        *,
        timeout: float = DEFAULT_PREFETCH_S,
    ) -> dict[str, Any]:
        """Have the node pull the chunks of ``keys`` (or of the full chunks of ``tokens``) it
        lacks from the nodes that own them, within ``timeout`` seconds; afterwards they are
        served like any local chunk. Returns counts of chunks ``pulled``, ``already_local``
        and ``missing`` (held nowhere, or not pulled in time) and ``source`` (the node they
        came from, or None). Needs the local socket and a node in a redis cluster."""
        return dict(
            self._call(
                Op.PREFETCH,
                requests.prefetch_args(ns, tokens, keys, timeout, packed=self._packs_keys()),
                timeout=timeout + PREFETCH_REPLY_MARGIN_S,
            )
        )

    def push(
        self,
        ns: Namespace,
        keys: Sequence[bytes],
        target: str,
        *,
        timeout: float = DEFAULT_PUSH_S,
        wire: str | None = None,
    ) -> dict[str, Any]:
        """Have the node push the chunks of ``keys`` to node ``target``, each layer as soon
        as it is committed here (the chunks may still be being written), within ``timeout``
        seconds. The chunks exist on ``target`` as soon as the push has reserved them there:
        its readers can wait on layer 0 while later layers are in flight. Returns counts of
        distinct chunks ``pushed`` (complete on ``target``), ``already_there`` and
        ``failed`` (not held here, or not pushed in time), and the bytes moved
        (``wire_bytes``; ``native_bytes`` in the namespace's dtype). ``wire``: "fp8" sends
        float chunks as e4m3 (half the bytes; they land in the namespace's dtype), "native"
        as they are; None: as the node's ``cluster.fp8_wire_peers`` says. Blocks until the
        push ends. Needs the local socket and a node in a redis cluster."""
        return dict(
            self._call(
                Op.PUSH,
                requests.push_args(ns, keys, target, timeout, wire),
                timeout=timeout + PREFETCH_REPLY_MARGIN_S,
            )
        )

    def reserve(
        self,
        ns: Namespace,
        key: bytes,
        *,
        parent: bytes = ROOT,
        num_tokens: int | None = None,
        heads: HeadRange | None = None,
        tokens: ChunkTokens | None = None,
    ) -> RemoteWriter:
        """Reserve a chunk to write; with ``heads``, only that KV-head range (one
        tensor-parallel rank: the other ranks reserve the same key with theirs).

        ``tokens``: the chunk's own token ids (int32-LE bytes, or integers), which the node
        keeps with it; they must hash to ``key`` (else ProtocolError, nothing reserved)."""
        args = requests.reserve_args(ns, key, parent, num_tokens, heads, tokens)
        session, reply = self._call_on_session(Op.RESERVE, args)
        return RemoteWriter(session, ns, key, reply, heads=heads)

    def put(
        self,
        ns: Namespace,
        key: bytes,
        data: Any,
        *,
        parent: bytes = ROOT,
        num_tokens: int | None = None,
        tokens: ChunkTokens | None = None,
    ) -> bool:
        """Store a whole payload; ``False`` if the node already holds the key. ``tokens``:
        as for :meth:`reserve`."""
        return put_whole(
            lambda: self.reserve(ns, key, parent=parent, num_tokens=num_tokens, tokens=tokens),
            data,
        )

    def reserve_many(
        self,
        ns: Namespace,
        chunks: Sequence[ChunkRef],
        *,
        heads: HeadRange | None = None,
        tokens: Sequence[ChunkTokens | None] | None = None,
    ) -> list[RemoteWriter | KVFabricError]:
        """Reserve many chunks in one round trip; each item is a writer or its own error
        (a chunk whose ``tokens`` do not hash to its key: ProtocolError). ``tokens``: each
        chunk's own token ids as for :meth:`reserve` (None where not given)."""
        session, items = self._call_on_session(
            Op.RESERVE_BATCH, requests.reserve_batch_args(ns, chunks, heads, tokens)
        )
        return [
            r if isinstance(r, KVFabricError) else RemoteWriter(session, ns, c.key, r, heads=heads)
            for c, r in zip(chunks, requests.item_results(items))
        ]

    def commit_many(self, writers: Sequence[RemoteWriter]) -> None:
        """Commit every layer of each writer in one round trip; raises the first failure."""
        if writers:
            requests.raise_first(_batch(writers, Op.COMMIT_BATCH))

    def commit_layer_many(self, writers: Sequence[RemoteWriter], layer: int) -> list[bool]:
        """Commit one layer of every writer in one round trip (readers of those chunks may
        read it now); True for each object that is now complete, whose handle closes.
        Raises the first failure."""
        if not writers:
            return []
        session = requests.lease_session(writers)
        items = session.call(Op.COMMIT_BATCH, requests.layer_commit_args(writers, layer))
        results = requests.item_results(items)
        requests.raise_first(results)
        for writer, result in zip(writers, results):
            writer.renewed(result)
            writer.closed = bool(result["done"])
        return [w.closed for w in writers]

    def put_many(
        self,
        ns: Namespace,
        chunks: Sequence[ChunkRef],
        payloads: Sequence[Any],
        *,
        tokens: Sequence[ChunkTokens | None] | None = None,
    ) -> list[bool]:
        """Store many chunks (e.g. a prompt's :func:`~kvfabric.hashing.chunk_hashes`), the
        daemon reserving and committing some while this copies others
        (:mod:`kvfabric.client.pipelined_put`); ``False`` where the node already held the
        chunk. ``tokens``: as for :meth:`reserve_many`."""
        if len(chunks) != len(payloads):
            raise ValueError("one payload per chunk")
        if not chunks:
            return []
        return pipelined_put.put_many(self._session(), ns, chunks, payloads, tokens)

    def get_many(
        self,
        ns: Namespace,
        keys: Sequence[bytes],
        *,
        timeout: float | None = None,
        want: ReadSpec | None = None,
    ) -> list[RemoteReader | None]:
        """Pin many chunks in one round trip; ``None`` where the node does not hold one."""
        session, items = self._call_on_session(
            Op.GET_BATCH, requests.get_batch_args(ns, keys, timeout, want)
        )
        results = requests.item_results(items)
        readers = [
            None if isinstance(r, KVFabricError) else RemoteReader(session, ns, k, r, want=want)
            for k, r in zip(keys, results)
        ]
        failures = [
            r for r in results if isinstance(r, KVFabricError) and not isinstance(r, NotFoundError)
        ]
        if failures:
            self.release_many([r for r in readers if r is not None])
            raise failures[0]
        return readers

    def release_many(self, readers: Sequence[RemoteReader | None]) -> None:
        """Give many pins back in one request, without waiting for the answer: the daemon
        runs a session's requests in order, so whatever this session asks next finds them
        released (another session may still see them pinned for a moment). A failure (a pin
        that ran out already) is logged, not raised."""
        live = [r for r in readers if r is not None and not r.closed]
        if live:
            session = requests.lease_session(live)
            session.send(Op.RELEASE_BATCH, requests.leases_args(live)).discard()

    def get(
        self,
        ns: Namespace,
        key: bytes,
        *,
        timeout: float | None = None,
        want: ReadSpec | None = None,
    ) -> RemoteReader:
        """Pin one chunk; ``want`` is how this consumer reads it (its dtype, KV-head range,
        layout: see :mod:`kvfabric.readspec`), validated by the daemon before it pins."""
        session, reply = self._call_on_session(Op.GET, requests.get_args(ns, key, timeout, want))
        return RemoteReader(session, ns, key, reply, want=want)

    def contains(self, ns: Namespace, keys: Sequence[bytes]) -> list[bool]:
        return list(
            self._call(Op.CONTAINS, requests.keys_args(ns, keys, packed=self._packs_keys()))
        )

    def delete(self, ns: Namespace, key: bytes) -> bool:
        return bool(self._call(Op.DELETE, requests.key_args(ns, key)))

    def intend(self, ns: Namespace, chunks: Sequence[tuple[ChunkRef, bytes]]) -> int:
        """Announce chunks this engine is about to compute, each a (ref, its own token ids
        as int32-LE) pair, so that routers hear of them before they are reserved; returns
        how many the node announced (see the ``intend`` op). UnsupportedError when the node
        publishes no KV events."""
        items = [
            {"key": ref.key, "parent": ref.parent, "num_tokens": ref.num_tokens, "tokens": ids}
            for ref, ids in chunks
        ]
        reply = self._call(Op.INTEND, {"ns": encode_namespace(ns), "items": items})
        return int(reply["announced"])

    def stats(self) -> dict[str, Any]:
        return dict(self._call(Op.STATS, {}))

    def kv_events(
        self, ns: Namespace, after: int, block_size: int, limit: int | None = None
    ) -> dict[str, Any]:
        """The namespace's inventory changes since ``after`` (-1: a snapshot first) as vLLM
        KV event maps for engine blocks of ``block_size`` tokens; see the ``kv_events`` op."""
        args: dict[str, Any] = {
            "ns": encode_namespace(ns),
            "after": after,
            "block_size": block_size,
        }
        if limit is not None:
            args["max"] = limit
        return dict(self._call(Op.KV_EVENTS, args))

    def ping(self) -> None:
        self._call(Op.PING, {})

    def _call(self, op: Op, args: dict[str, Any], timeout: float | None = None) -> Any:
        return self._call_on_session(op, args, timeout)[1]

    def _call_on_session(
        self, op: Op, args: dict[str, Any], timeout: float | None = None
    ) -> tuple[Connection, Any]:
        """``timeout``: for the reply (default: the client's)."""
        give_up = time.monotonic() + self.reconnect_timeout
        attempt = 0
        while True:
            try:
                session = self._session()
                return session, session.call(op, args, timeout)
            except UnavailableError:
                if not self.reconnect or time.monotonic() >= give_up:
                    raise
                time.sleep(self._backoff.delay(attempt))
                attempt += 1

    def _packs_keys(self) -> bool:
        try:
            return requests.packs_keys(self._session().hello)
        except UnavailableError:
            return False  # the list form every daemon takes; the call itself reconnects

    def _session(self) -> Connection:
        with self._lock:
            if self._connection is None or self._connection.closed:
                self._connection = None
                self._connection = Connection(
                    self.address,
                    token=self._token,
                    timeout=self.timeout,
                    client=self.engine,
                    backoff=self._backoff,
                    tls=self._tls,
                )
            return self._connection

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.close()
                self._connection = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _batch(leases: Sequence[RemoteWriter | RemoteReader], op: Op) -> list[Any]:
    """One batch request over the session the leases live on; closes their handles."""
    session = requests.lease_session(leases)
    items = session.call(op, requests.leases_args(leases))
    return requests.item_results(items)
