"""The control server: Unix-socket (local clients) and TCP (remote tooling) listeners.

Per connection: frames are decoded with size limits (:mod:`kvfabric.protocol.frames`); the
first request must be ``hello`` (authenticated when tokens are configured), and on the Unix
socket its reply carries the arena file descriptors (SCM_RIGHTS) so the client can map the
shared memory. After that, a request that can be answered without waiting (most: the store
says when it would wait for room, an SSD read or a layer) is answered as soon as it is read,
on the event loop; the others run concurrently as tasks, on worker threads or parked until a
layer lands (at most ``MAX_IN_FLIGHT`` per connection). A small batch of independent items
(reserve_batch, get_batch) is tried on the loop too, and only its items that would wait go to
a worker thread. Replies carry the request id and may come back out of order.

Bad input never takes the daemon down: a malformed request gets an error reply; a broken
frame (garbage length, undecodable body) gets an error reply and the connection is closed,
because the stream can no longer be trusted. When a connection ends, its session's leases
are given back. Every request is timed and its error counted, hello included: a refused
session (bad or missing token, too many sessions) shows in ``kvfabric_request_errors_total``
as well as in ``kvfabric_control_connections_closed_total``.

Floods and slow clients are bounded (:mod:`kvfabric.server.admission`): before its hello a
connection may send one small frame (``limits.control_hello_max_bytes``) within
``limits.control_hello_timeout_s``; connections waiting for hello are few (the one silent
the longest goes first, never one whose hello is waiting to be read) and do not count against
``max_sessions``; the Unix listener drains its accept queue and refuses what the bounds
would push out unread before it costs a transport
(:mod:`kvfabric.server.unix_listener`); a peer's sessions are capped; idle
sessions are closed. Large legal requests (a 65,536-key ``contains``, a lookup of millions
of token ids) are answered in slices on the loop (:mod:`kvfabric.server.slices`), and a
connection whose requests keep arriving gives the loop back every few milliseconds, so no
client holds the others up for longer than that.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import socket
import ssl
import threading
import time
from array import array
from collections.abc import Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfabric.api.transfers import RecentTransfers
from kvfabric.config import Limits
from kvfabric.errors import (
    AuthError,
    DeadlineExceededError,
    ForbiddenError,
    FrameTooLargeError,
    KVFabricError,
    ProtocolError,
    UnavailableError,
    WouldBlockError,
)
from kvfabric.logfmt import add_context, request_context
from kvfabric.protocol.frames import MAX_FRAME, FrameDecoder, encode_frame
from kvfabric.protocol.messages import Op, error_reply, ok_reply, parse_request, request_id_of
from kvfabric.server import handlers, slices
from kvfabric.server.admission import Admission, Conn, CountingReader
from kvfabric.server.handlers import Context
from kvfabric.server.session import Session
from kvfabric.server.traffic import Traffic, traffic_of
from kvfabric.server.unix_listener import UnixListener

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 64
MAX_BLOCKING_PER_SESSION = 4  # worker threads one session may hold: none can starve the rest
LOOP_BATCH_ITEMS = 64  # batches up to this many items are tried on the loop first
READ_CHUNK = 1 << 16
TLS_HANDSHAKE_S = 5.0  # TCP plane with TLS: a handshake that takes longer is dropped


class ControlServer:
    """Accepts sessions and dispatches their requests to :mod:`kvfabric.server.handlers`."""

    def __init__(
        self,
        ctx: Context,
        executor: Executor,
        metrics: Any,
        *,
        socket_path: str,
        tcp_listener: socket.socket | None,
        max_sessions: int,
        tcp_ssl: ssl.SSLContext | None = None,
        limits: Limits | None = None,
        transfers: RecentTransfers | None = None,
    ) -> None:
        """``tcp_listener``: a bound, listening socket for remote sessions (bound by the
        caller, so its port is known before the server starts), or None; ``tcp_ssl``: serve
        TLS on it (see :mod:`kvfabric.server.tls`); ``limits``: the ``control_*`` bounds
        (default: the defaults, with ``max_sessions``); ``transfers``: where each request
        that moved KV is recorded (:mod:`kvfabric.api.transfers`)."""
        self._limits = limits if limits is not None else Limits(max_sessions=max_sessions)
        self._admission = Admission(self._limits, metrics)
        self._sweeper: asyncio.Task[None] | None = None
        self._tcp_ssl = tcp_ssl
        self._ctx = ctx
        self._executor = executor
        self._metrics = metrics
        self._transfers = transfers
        self._socket_path = Path(socket_path)
        self._tcp_listener = tcp_listener
        self._servers: list[asyncio.Server] = []  # TCP
        self._unix: UnixListener | None = None
        self._adopting: set[asyncio.Task[Any]] = set()
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._layers_changed = asyncio.Event()  # replaced each time it fires
        self._layer_waiters = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0

    @property
    def session_count(self) -> int:
        return self._admission.session_count

    @property
    def tcp_port(self) -> int | None:
        for server in self._servers:
            port: int = server.sockets[0].getsockname()[1]
            return port
        return None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._ctx.store.add_layer_listener(self._on_layers_changed)
        self._socket_path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_socket(self._socket_path)
        loop = self._loop
        assert loop is not None
        # the Unix listener screens what it accepts before it costs a transport (floods)
        self._unix = UnixListener(
            str(self._socket_path),
            self._limits.control_listen_backlog,
            loop,
            self._admission.look,
            self._admission.trim,
            self._adopt,
        )
        if self._tcp_listener is not None:
            tcp = await loop.create_server(
                lambda: self._protocol(local=False),
                sock=self._tcp_listener,
                ssl=self._tcp_ssl,
                backlog=self._limits.control_listen_backlog,
                ssl_handshake_timeout=TLS_HANDSHAKE_S if self._tcp_ssl else None,
            )
            self._servers.append(tcp)
        self._sweeper = asyncio.create_task(self._sweep())

    def _adopt(self, sock: socket.socket) -> None:
        """A Unix connection the listener accepted and kept: served like any (see _serve)."""
        assert self._loop is not None
        task = self._loop.create_task(
            self._loop.connect_accepted_socket(lambda: self._protocol(local=True), sock=sock)
        )
        self._adopting.add(task)
        task.add_done_callback(lambda t: _adopted(t, sock, self._adopting))

    def _protocol(self, *, local: bool) -> asyncio.StreamReaderProtocol:
        """What asyncio.start_(unix_)server builds, with a reader that counts what it holds
        unread (admission passes over a connection whose hello is waiting in it)."""
        reader = CountingReader(limit=READ_CHUNK, loop=self._loop)
        return asyncio.StreamReaderProtocol(
            reader, lambda r, w: self._serve(r, w, local=local), loop=self._loop
        )

    async def _sweep(self) -> None:
        """Idle sessions closed, refusals logged (rate-limited), every so often."""
        while True:
            await asyncio.sleep(self._admission.sweep_interval())
            try:
                self._admission.sweep()
            except Exception:  # a bug here must not end the sweeps for good
                log.exception("control plane sweep failed")

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, let in-flight requests finish (up to ``grace_s``), close sessions."""
        if self._unix is not None:
            self._unix.close()
        for server in self._servers:
            server.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace_s)
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._admission.close_all()
        for server in self._servers:
            await server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            self._socket_path.unlink()

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, local: bool
    ) -> None:
        conn = self._admission.accept(
            writer, local=local, reader=reader if isinstance(reader, CountingReader) else None
        )
        session = Session(local=local, max_leases=self._ctx.max_leases)
        # until hello, a frame may be small: an unauthenticated peer holds at most that
        decoder = FrameDecoder(self._limits.control_hello_max_bytes)
        slots = asyncio.Semaphore(MAX_IN_FLIGHT)
        blocking = asyncio.Semaphore(MAX_BLOCKING_PER_SESSION)
        tasks: set[asyncio.Task[None]] = set()
        pace = slices.Pacer()
        try:
            while True:
                data = await reader.read(READ_CHUNK)
                if not data:
                    break
                self._admission.heard(conn)
                frames = decoder.feed(data)
                while (message := self._next_message(conn, frames)) is not None:
                    if not session.authenticated:
                        if not await self._hello(conn, session, message, writer):
                            return
                        decoder.limit = MAX_FRAME
                        continue
                    started = time.perf_counter()
                    # its log lines carry its id, op, namespace, tenant (kvfabric.logfmt); the
                    # task made for one that waits copies them
                    with request_context(request_id=request_id_of(message), tenant=session.tenant):
                        answer = self._answer_now(session, message)
                        if isinstance(answer, _Answer):
                            await self._reply(writer, answer, started)
                            _log_answer(answer, started)
                            continue
                        await slots.acquire()
                        task = asyncio.create_task(
                            self._dispatch(session, answer, writer, blocking, started)
                        )
                    tasks.add(task)
                    conn.in_flight += 1
                    task.add_done_callback(lambda t: _task_done(t, tasks, slots, conn))
                if conn.closing:
                    break  # the stream is out of sync: nothing after this can be trusted
                # read() returns at once while the client keeps data buffered: give the
                # loop to the others every few milliseconds all the same
                await pace()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            self._admission.release(conn)
            leases = session.close()
            if leases:
                log.info("session %d ended with %d open lease(s); given back", session.id, leases)
            if conn.session is not None:
                self._metrics.session_closed()
            writer.close()

    def _next_message(self, conn: Conn, frames: Iterator[dict[str, Any]]) -> dict[str, Any] | None:
        """The next decoded message; None when the data read so far holds no more, or when
        the frame was broken (then the connection is closed, with an error reply)."""
        try:
            return next(frames, None)
        except ProtocolError as exc:
            reason = "frame_too_large" if isinstance(exc, FrameTooLargeError) else "bad_frame"
            self._admission.close(conn, reason, exc)
            return None

    async def _hello(
        self, conn: Conn, session: Session, message: Any, writer: asyncio.StreamWriter
    ) -> bool:
        request_id = request_id_of(message)
        started = time.perf_counter()
        try:
            request_id, op, args = parse_request(message)
            if op is not Op.HELLO:
                raise AuthError("a session must start with hello")
            result, fds = handlers.hello(self._ctx, session, args)
            self._admission.admit(conn, session)  # or UnavailableError: too many sessions
            self._metrics.session_opened()
            frame = encode_frame(ok_reply(request_id, result))
            await writer.drain()
            if fds:
                await _send_with_fds(writer, frame, fds)
            else:
                writer.write(frame)
                await writer.drain()
            self._metrics.observe_request(Op.HELLO.value, time.perf_counter() - started, None)
            return True
        except KVFabricError as exc:
            if conn.session is None and not isinstance(exc, UnavailableError):
                self._admission.refused(conn, "bad_hello")  # counted, logged rate-limited
            log.debug("session %d refused: %s", session.id, exc)
            # a refused session (bad token, too many sessions) is a failed request too:
            # kvfabric_request_errors_total{op="hello", kind="auth" / "unavailable"}
            self._metrics.observe_request(Op.HELLO.value, time.perf_counter() - started, exc.kind)
            await _send(writer, error_reply(request_id, exc))
            return False

    def _answer_now(self, session: Session, message: Any) -> _Answer | _Pending:
        """The answer to a request, computed on the loop; or, for one that has to wait, what
        :meth:`_dispatch` needs to run it (as a task: the connection reads on meanwhile)."""
        request_id, op_name = request_id_of(message), "invalid"
        try:
            request_id, op, args = parse_request(message)
            op_name = op.value
            add_context(op=op_name)
            handler = handlers.HANDLERS.get(op)
            if handler is None:
                raise ProtocolError(f"{op.value} is only valid as a session's first request")
            if handler.local and not session.local:
                raise ForbiddenError(f"{op.value} maps shared memory: use the local socket")
            if slices.is_large(op, args):  # answered a slice at a time, as a task
                return _Pending(request_id, op, handler, args, sliced=True)
            if handler.waits_for_layers or (
                handler.blocking
                and handler.batch
                and not (handler.items and _loop_sized(args.get(handler.items)))
            ):
                # a batch's items done before a wait could not be redone
                return _Pending(request_id, op, handler, args)
            if handler.blocking:
                try:
                    with self._ctx.store.nonblocking():
                        result = handler.fn(self._ctx, session, args)
                except WouldBlockError:
                    return _Pending(request_id, op, handler, args)
                if handler.batch:
                    redo = [i for i, item in enumerate(result) if _would_block(item)]
                    if redo:
                        return _Pending(request_id, op, handler, args, result, redo)
            else:
                result = handler.fn(self._ctx, session, args)
            return self._ok(session, request_id, op, result)
        except Exception as exc:
            return _failed(request_id, op_name, exc)

    async def _dispatch(
        self,
        session: Session,
        pending: _Pending,
        writer: asyncio.StreamWriter,
        blocking: asyncio.Semaphore,
        started: float,
    ) -> None:
        """Run a request that waits: on a worker thread, or parked until a layer lands."""
        self._begin()
        try:
            if pending.sliced:
                result = await slices.answer(self._ctx, session, pending.op, pending.args)
            elif pending.handler.waits_for_layers:
                result = await self._run_waiting(pending.handler, session, pending.args)
            elif pending.redo:
                result = await self._redo_items(pending, session, blocking)
            else:
                result = await self._run_blocking(pending.handler, session, pending.args, blocking)
            answer = self._ok(session, pending.request_id, pending.op, result)
        except Exception as exc:
            answer = _failed(pending.request_id, pending.op.value, exc)
        finally:
            self._end()
        with contextlib.suppress(ConnectionError):
            await self._reply(writer, answer, started)
        _log_answer(answer, started)

    def _ok(self, session: Session, request_id: int, op: Op, result: Any) -> _Answer:
        return _Answer(
            ok_reply(request_id, result), op.value, None, session.client, traffic_of(op, result)
        )

    async def _reply(self, writer: asyncio.StreamWriter, answer: _Answer, started: float) -> None:
        try:
            await _send(writer, answer.reply)
        except ProtocolError as exc:  # the result did not fit in a frame
            await _send(writer, error_reply(answer.reply["id"], exc))
        finally:  # recorded once the reply is out: off the client's round trip
            self._metrics.observe_request(
                answer.op_name, time.perf_counter() - started, answer.error_kind
            )
            if answer.traffic is not None:
                self._metrics.count_engine_traffic(answer.engine, **answer.traffic.metric_counts())
                moved = answer.traffic.transfer()
                if moved is not None and self._transfers is not None:
                    kind, chunks, nbytes, tokens = moved
                    self._transfers.record(
                        kind, answer.engine, chunks, nbytes=nbytes, tokens=tokens
                    )

    async def _run_blocking(
        self,
        handler: handlers.Handler,
        session: Session,
        args: dict[str, Any],
        slots: asyncio.Semaphore,
    ) -> Any:
        """On a worker thread (at most ``MAX_BLOCKING_PER_SESSION`` per session): a batch not
        tried on the loop, or a request the store said would wait when :meth:`_answer_now`
        tried it there."""
        async with slots:
            loop = asyncio.get_running_loop()
            # in a copy of this context: the handler's log lines name the request too
            run = contextvars.copy_context().run
            return await loop.run_in_executor(
                self._executor, run, handler.fn, self._ctx, session, args
            )

    async def _redo_items(
        self, pending: _Pending, session: Session, blocking: asyncio.Semaphore
    ) -> list[Any]:
        """The items of a batch tried on the loop that would have waited, redone on a worker
        thread (they did nothing: the store refuses before changing anything), in their
        places among the others' results."""
        items_arg = pending.handler.items
        items = pending.args[items_arg]
        redone = await self._run_blocking(
            pending.handler,
            session,
            {**pending.args, items_arg: [items[i] for i in pending.redo]},
            blocking,
        )
        result = list(pending.done)
        for i, item in zip(pending.redo, redone):
            result[i] = item
        return result

    async def _run_waiting(
        self, handler: handlers.Handler, session: Session, args: dict[str, Any]
    ) -> Any:
        """Layer waits park on the loop, not on threads: re-try whenever a layer lands."""
        deadline = time.monotonic() + handlers.wait_timeout(args)
        self._layer_waiters += 1
        try:
            while True:
                changed = self._layers_changed  # taken before the check: no wake-up is lost
                try:
                    with self._ctx.store.nonblocking():
                        return handler.fn(self._ctx, session, args)
                except WouldBlockError:
                    pass
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineExceededError("the layer was not committed before the deadline")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), remaining)
        finally:
            self._layer_waiters -= 1

    def _on_layers_changed(self) -> None:  # any thread, under the store lock
        # A waiter counts itself before its first check, so none is missed when this skips;
        # commits made on the loop itself need no cross-thread wake-up.
        if not self._layer_waiters or self._loop is None or self._loop.is_closed():
            return
        if threading.get_ident() == self._loop_thread:
            self._loop.call_soon(self._fire_layers_changed)
        else:
            self._loop.call_soon_threadsafe(self._fire_layers_changed)

    def _fire_layers_changed(self) -> None:
        fired, self._layers_changed = self._layers_changed, asyncio.Event()
        fired.set()

    def _begin(self) -> None:
        self._in_flight += 1
        self._idle.clear()

    def _end(self) -> None:
        self._in_flight -= 1
        if not self._in_flight:
            self._idle.set()


@dataclass(frozen=True)
class _Answer:
    reply: dict[str, Any]
    op_name: str  # for the request metrics: "invalid" when the envelope was not understood
    error_kind: str | None  # None: it succeeded
    engine: str = ""  # the session's client, and what the request moved, for the
    traffic: Traffic | None = None  # per-engine traffic metrics


@dataclass(frozen=True)
class _Pending:
    request_id: int
    op: Op
    handler: handlers.Handler
    args: dict[str, Any]
    # a batch tried on the loop: its items' results, and the positions of the items that
    # would have waited (none: not a batch tried on the loop)
    done: list[Any] = field(default_factory=list)
    redo: list[int] = field(default_factory=list)
    sliced: bool = False  # a large request: answered by kvfabric.server.slices


def _task_done(
    task: asyncio.Task[None], tasks: set[asyncio.Task[None]], slots: asyncio.Semaphore, conn: Conn
) -> None:
    tasks.discard(task)
    slots.release()
    conn.in_flight -= 1
    conn.touch()  # a long request that just ended: the idle clock starts now


def _adopted(
    task: asyncio.Task[Any], sock: socket.socket, adopting: set[asyncio.Task[Any]]
) -> None:
    adopting.discard(task)
    if task.cancelled() or task.exception() is not None:
        sock.close()  # no transport took it (the client left, or shutting down)


def _loop_sized(items: Any) -> bool:
    """A batch small enough to try on the loop (a big one would stall other sessions)."""
    return isinstance(items, list) and len(items) <= LOOP_BATCH_ITEMS


def _would_block(item: Any) -> bool:
    return (
        isinstance(item, dict)
        and item.get("ok") is False
        and item["error"]["kind"] == WouldBlockError.kind
    )


def _log_answer(answer: _Answer, started: float) -> None:
    """The access log: one debug line per request, in its context (id, op, namespace)."""
    if log.isEnabledFor(logging.DEBUG):
        ms = (time.perf_counter() - started) * 1e3
        log.debug("%s %s in %.3f ms", answer.op_name, answer.error_kind or "ok", ms)


def _failed(request_id: int, op_name: str, exc: Exception) -> _Answer:
    if isinstance(exc, KVFabricError):
        return _Answer(error_reply(request_id, exc), op_name, exc.kind)
    # a bug must cost one request, not the daemon
    log.error("internal error in %s", op_name, exc_info=exc)
    return _Answer(
        error_reply(request_id, KVFabricError(f"internal error: {exc!r}")), op_name, "internal"
    )


async def _send(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    if writer.is_closing():
        return
    writer.write(encode_frame(message))
    await writer.drain()


async def _send_with_fds(writer: asyncio.StreamWriter, frame: bytes, fds: list[int]) -> None:
    """Send ``frame`` with ``fds`` attached (SCM_RIGHTS) on the connection's Unix socket.

    The transport's buffer is empty (drained), so writing on a duplicate of its socket keeps
    the byte order; whatever the kernel did not take goes through the transport.
    """
    transport_socket = writer.get_extra_info("socket")
    raw = socket.socket(fileno=os.dup(transport_socket.fileno()))
    try:
        for _ in range(100):
            try:
                sent = raw.sendmsg(
                    [frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array("i", fds))]
                )
                break
            except BlockingIOError:
                await asyncio.sleep(0.01)
        else:
            raise ConnectionError("could not pass the arena descriptors")
    finally:
        raw.close()
    if sent < len(frame):
        writer.write(frame[sent:])
    await writer.drain()


def _remove_stale_socket(path: Path) -> None:
    """A socket file left by a crashed daemon blocks bind; one that answers is a live daemon."""
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_socket():
        raise KVFabricError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink()
        return
    finally:
        probe.close()
    raise KVFabricError(f"another daemon is already serving {path}")
