"""The asyncio client: the same operations as :class:`~kvfabric.client.Client`, awaitable.

One connection multiplexes concurrent requests (replies are matched by request id), so many
coroutines can wait on layers, lookups and puts at once. The handshake (which receives the
arena descriptors) runs once in a worker thread; after it the socket belongs to asyncio.
Over TLS (a TCP address with a ``tls`` option, see :mod:`kvfabric.client.tls`) the TLS
session and the hello run on asyncio's streams instead (an ``ssl.SSLSocket`` cannot be
handed to asyncio); a busy daemon is retried the same way. Reconnects follow the same rules
as the blocking client.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import ssl
import time
from collections.abc import Sequence
from typing import Any

from kvfabric.client import requests
from kvfabric.client import tls as client_tls
from kvfabric.client.client import (
    DEFAULT_PREFETCH_S,
    DEFAULT_PUSH_S,
    PREFETCH_REPLY_MARGIN_S,
    default_address,
)
from kvfabric.client.connection import (
    CLIENT_NAME,
    Address,
    map_arenas,
    open_session,
    open_socket,
    result_of,
)
from kvfabric.client.objects import AsyncRemoteReader, AsyncRemoteWriter
from kvfabric.client.retry import Backoff, ExponentialBackoff
from kvfabric.client.tls import TLSOption
from kvfabric.errors import (
    AlreadyExistsError,
    DeadlineExceededError,
    KVFabricError,
    NotFoundError,
    ProtocolError,
    UnavailableError,
)
from kvfabric.hashing import ROOT, ChunkRef
from kvfabric.lookup import LookupResult
from kvfabric.payload import HeadRange
from kvfabric.protocol.frames import FrameDecoder, encode_frame
from kvfabric.protocol.messages import Op, request
from kvfabric.readspec import ReadSpec


class AsyncConnection:
    """One authenticated session driven by asyncio; concurrent calls are multiplexed."""

    def __init__(self) -> None:
        self.closed = True
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)

    @classmethod
    async def open(
        cls, address: Address, token: str | None, timeout: float, tls: TLSOption = None
    ) -> AsyncConnection:
        self = cls()
        self.timeout = timeout
        if tls is not None and isinstance(address, tuple):
            self._reader, self._writer, decoder, self.hello = await _tls_session(
                address, token, tls, time.monotonic() + timeout
            )
            self.arenas = map_arenas(self.hello, [])  # TCP: no descriptors, nothing mapped
            self.closed = False
            self._pump = asyncio.create_task(self._read_replies(decoder))
            return self
        loop = asyncio.get_running_loop()

        def connect() -> tuple[Any, FrameDecoder, dict[str, Any], list[int]]:
            # a thread: a busy daemon is retried with backoff (see open_session)
            sock, decoder, hello, fds = open_session(address, token, time.monotonic() + timeout)
            sock.setblocking(False)
            return sock, decoder, hello, fds

        sock, decoder, self.hello, fds = await loop.run_in_executor(None, connect)
        try:
            self.arenas = map_arenas(self.hello, fds)
        except BaseException:
            sock.close()
            raise
        try:
            if isinstance(address, tuple):
                self._reader, self._writer = await asyncio.open_connection(sock=sock)
            else:
                self._reader, self._writer = await asyncio.open_unix_connection(sock=sock)
        except OSError as exc:
            sock.close()
            self.arenas.close()
            raise UnavailableError(f"lost the daemon after hello: {exc}") from None
        self.closed = False
        self._pump = asyncio.create_task(self._read_replies(decoder))
        return self

    async def call(self, op: Op, args: dict[str, Any], timeout: float | None = None) -> Any:
        if self.closed:
            raise UnavailableError("connection is closed")
        request_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            self._writer.write(encode_frame(request(request_id, op, args)))
            await self._writer.drain()
            reply = await asyncio.wait_for(future, self.timeout if timeout is None else timeout)
        except TimeoutError:
            raise DeadlineExceededError(f"{op.value}: no reply before the deadline") from None
        except ConnectionError as exc:
            self.close()
            raise UnavailableError(f"lost the daemon during {op.value}: {exc}") from None
        finally:
            self._pending.pop(request_id, None)
        return result_of(reply)

    async def _read_replies(self, decoder: FrameDecoder) -> None:
        error: Exception = UnavailableError("the daemon closed the connection")
        try:
            while data := await self._reader.read(1 << 16):
                for message in decoder.feed(data):
                    future = self._pending.get(message.get("id"))  # late replies are dropped
                    if future is not None and not future.done():
                        future.set_result(message)
        except (OSError, ProtocolError) as exc:  # ssl.SSLError too
            error = UnavailableError(f"lost the daemon: {exc}")
        finally:
            self.close()
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(error)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._writer.close()
            self.arenas.close()


class AsyncClient:
    """``await AsyncClient.connect(...)``; every request method is a coroutine."""

    def __init__(
        self,
        address: Address,
        token: str | None,
        timeout: float,
        reconnect: bool,
        reconnect_timeout: float,
        backoff: Backoff,
        tls: TLSOption = None,
    ) -> None:
        self.address, self._token, self.timeout, self._tls = address, token, timeout, tls
        self.reconnect, self.reconnect_timeout, self._backoff = (
            reconnect,
            reconnect_timeout,
            backoff,
        )
        self._connection: AsyncConnection | None = None
        self._connecting = asyncio.Lock()

    @classmethod
    async def connect(
        cls,
        address: Address | None = None,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        reconnect: bool = True,
        reconnect_timeout: float = 30.0,
        backoff: Backoff | None = None,
        tls: TLSOption = None,
    ) -> AsyncClient:
        """``tls``: as for :class:`~kvfabric.client.Client` (a TCP address over TLS)."""
        client = cls(
            address if address is not None else default_address(),
            token if token is not None else os.environ.get("KVFABRIC_TOKEN"),
            timeout,
            reconnect,
            reconnect_timeout,
            backoff or ExponentialBackoff(),
            tls,
        )
        await client._session()
        return client

    async def lookup(
        self,
        ns: Any,
        tokens: Any = None,
        *,
        keys: Sequence[bytes] | None = None,
        num_tokens: int | None = None,
    ) -> LookupResult:
        """See :meth:`kvfabric.client.Client.lookup` (local scope)."""
        return requests.lookup_result(
            await self._call(
                Op.LOOKUP,
                requests.lookup_args(
                    ns, tokens, keys, packed=await self._packs_keys(), num_tokens=num_tokens
                ),
            )
        )

    async def prefetch(
        self,
        ns: Any,
        keys: Sequence[bytes] | None = None,
        tokens: Any = None,
        *,
        timeout: float = DEFAULT_PREFETCH_S,
    ) -> dict[str, Any]:
        """See :meth:`kvfabric.client.Client.prefetch`."""
        return dict(
            await self._call(
                Op.PREFETCH,
                requests.prefetch_args(ns, tokens, keys, timeout, packed=await self._packs_keys()),
                timeout + PREFETCH_REPLY_MARGIN_S,
            )
        )

    async def push(
        self, ns: Any, keys: Sequence[bytes], target: str, *, timeout: float = DEFAULT_PUSH_S
    ) -> dict[str, Any]:
        """See :meth:`kvfabric.client.Client.push`."""
        return dict(
            await self._call(
                Op.PUSH,
                requests.push_args(ns, keys, target, timeout),
                timeout + PREFETCH_REPLY_MARGIN_S,
            )
        )

    async def reserve(
        self,
        ns: Any,
        key: bytes,
        *,
        parent: bytes = ROOT,
        num_tokens: int | None = None,
        heads: HeadRange | None = None,
    ) -> AsyncRemoteWriter:
        session, reply = await self._call_on_session(
            Op.RESERVE, requests.reserve_args(ns, key, parent, num_tokens, heads)
        )
        return AsyncRemoteWriter(session, ns, key, reply, heads=heads)

    async def put(
        self, ns: Any, key: bytes, data: Any, *, parent: bytes = ROOT, num_tokens: int | None = None
    ) -> bool:
        try:
            writer = await self.reserve(ns, key, parent=parent, num_tokens=num_tokens)
        except AlreadyExistsError:
            return False
        async with writer:
            writer.write(data)
            await writer.commit()
        return True

    async def reserve_many(
        self, ns: Any, chunks: Sequence[ChunkRef], *, heads: HeadRange | None = None
    ) -> list[AsyncRemoteWriter | KVFabricError]:
        session, items = await self._call_on_session(
            Op.RESERVE_BATCH, requests.reserve_batch_args(ns, chunks, heads)
        )
        return [
            r
            if isinstance(r, KVFabricError)
            else AsyncRemoteWriter(session, ns, c.key, r, heads=heads)
            for c, r in zip(chunks, requests.item_results(items))
        ]

    async def commit_many(self, writers: Sequence[AsyncRemoteWriter]) -> None:
        if writers:
            session = requests.lease_session(writers)
            items = await session.call(Op.COMMIT_BATCH, requests.leases_args(writers))
            requests.raise_first(requests.item_results(items))

    async def put_many(
        self, ns: Any, chunks: Sequence[ChunkRef], payloads: Sequence[Any]
    ) -> list[bool]:
        """As :meth:`kvfabric.client.Client.put_many`: two round trips for all chunks."""
        if len(chunks) != len(payloads):
            raise ValueError("one payload per chunk")
        results = await self.reserve_many(ns, chunks)
        writers = [r for r in results if isinstance(r, AsyncRemoteWriter)]
        try:
            requests.raise_first(
                [r for r in results if not isinstance(r, (AsyncRemoteWriter, AlreadyExistsError))]
            )
            for result, data in zip(results, payloads):
                if isinstance(result, AsyncRemoteWriter):
                    result.write(data)
        except BaseException:
            for writer in writers:
                await writer.abort()
            raise
        await self.commit_many(writers)
        return [isinstance(r, AsyncRemoteWriter) for r in results]

    async def get_many(
        self,
        ns: Any,
        keys: Sequence[bytes],
        *,
        timeout: float | None = None,
        want: ReadSpec | None = None,
    ) -> list[AsyncRemoteReader | None]:
        session, items = await self._call_on_session(
            Op.GET_BATCH, requests.get_batch_args(ns, keys, timeout, want)
        )
        results = requests.item_results(items)
        readers = [
            None
            if isinstance(r, KVFabricError)
            else AsyncRemoteReader(session, ns, k, r, want=want)
            for k, r in zip(keys, results)
        ]
        failures = [
            r for r in results if isinstance(r, KVFabricError) and not isinstance(r, NotFoundError)
        ]
        if failures:
            await self.release_many(readers)
            raise failures[0]
        return readers

    async def release_many(self, readers: Sequence[AsyncRemoteReader | None]) -> None:
        live = [r for r in readers if r is not None and not r.closed]
        if live:
            session = requests.lease_session(live)
            items = await session.call(Op.RELEASE_BATCH, requests.leases_args(live))
            requests.raise_first(requests.item_results(items))

    async def get(
        self, ns: Any, key: bytes, *, timeout: float | None = None, want: ReadSpec | None = None
    ) -> AsyncRemoteReader:
        session, reply = await self._call_on_session(
            Op.GET, requests.get_args(ns, key, timeout, want)
        )
        return AsyncRemoteReader(session, ns, key, reply, want=want)

    async def contains(self, ns: Any, keys: Sequence[bytes]) -> list[bool]:
        return list(
            await self._call(
                Op.CONTAINS, requests.keys_args(ns, keys, packed=await self._packs_keys())
            )
        )

    async def delete(self, ns: Any, key: bytes) -> bool:
        return bool(await self._call(Op.DELETE, requests.key_args(ns, key)))

    async def stats(self) -> dict[str, Any]:
        return dict(await self._call(Op.STATS, {}))

    async def ping(self) -> None:
        await self._call(Op.PING, {})

    async def _call(self, op: Op, args: dict[str, Any], timeout: float | None = None) -> Any:
        return (await self._call_on_session(op, args, timeout))[1]

    async def _call_on_session(
        self, op: Op, args: dict[str, Any], timeout: float | None = None
    ) -> tuple[AsyncConnection, Any]:
        """``timeout``: for the reply (default: the client's)."""
        give_up = time.monotonic() + self.reconnect_timeout
        attempt = 0
        while True:
            try:
                session = await self._session()
                return session, await session.call(op, args, timeout)
            except UnavailableError:
                if not self.reconnect or time.monotonic() >= give_up:
                    raise
                await asyncio.sleep(self._backoff.delay(attempt))
                attempt += 1

    async def _packs_keys(self) -> bool:
        try:
            return requests.packs_keys((await self._session()).hello)
        except UnavailableError:
            return False  # the list form every daemon takes; the call itself reconnects

    async def _session(self) -> AsyncConnection:
        async with self._connecting:
            if self._connection is None or self._connection.closed:
                self._connection = await AsyncConnection.open(
                    self.address, self._token, self.timeout, self._tls
                )
            return self._connection

    async def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _tls_session(
    address: tuple[str, int], token: str | None, tls: Any, deadline: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, FrameDecoder, dict[str, Any]]:
    """Connect, TLS and hello before ``deadline`` (monotonic), on asyncio streams; a busy
    daemon (closed during the handshake, or ``unavailable``) is asked again with backoff, a
    certificate problem (AuthError) is not."""
    loop = asyncio.get_running_loop()
    backoff = ExponentialBackoff()
    attempt = 0
    while True:
        left = _left(deadline, "connect")

        def connect(left: float = left) -> tuple[Any, ssl.SSLContext, str]:
            context, name = client_tls.resolve(tls, address[0])  # reads files: off the loop
            return open_socket(address, left, backoff), context, name

        sock, context, name = await loop.run_in_executor(None, connect)
        try:
            return await _tls_hello(sock, context, name, token, deadline)
        except UnavailableError:
            pause = backoff.delay(attempt)
            if time.monotonic() + pause >= deadline:
                raise
            await asyncio.sleep(pause)
            attempt += 1


async def _tls_hello(
    sock: Any, context: ssl.SSLContext, name: str, token: str | None, deadline: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, FrameDecoder, dict[str, Any]]:
    sock.setblocking(False)
    try:
        left = _left(deadline, "TLS handshake")
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(
                sock=sock, ssl=context, server_hostname=name, ssl_handshake_timeout=left
            ),
            left,
        )
    except BaseException as exc:
        sock.close()
        raise _typed(exc, "TLS handshake") from None
    try:
        writer.write(encode_frame(request(0, Op.HELLO, {"token": token, "client": CLIENT_NAME})))
        decoder = FrameDecoder()
        while True:
            data = await asyncio.wait_for(reader.read(1 << 16), _left(deadline, "hello"))
            if not data:
                raise UnavailableError("the daemon closed the connection during hello")
            for message in decoder.feed(data):
                return reader, writer, decoder, result_of(message)
    except BaseException as exc:
        writer.close()
        raise _typed(exc, "hello") from None


def _typed(exc: BaseException, what: str) -> BaseException:
    if isinstance(exc, KVFabricError) or not isinstance(exc, Exception):
        return exc
    if isinstance(exc, asyncio.TimeoutError):
        return DeadlineExceededError(f"{what}: no answer from the daemon before the deadline")
    if isinstance(exc, ssl.SSLError):
        return client_tls.failure(exc, "the daemon")
    if isinstance(exc, OSError):
        return UnavailableError(f"lost the daemon during {what}: {exc}")
    return exc


def _left(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceededError(f"{what}: deadline exceeded")
    return left
