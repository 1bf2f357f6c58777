"""Hostile and malformed input against a live daemon, over a raw Unix socket.

Every case must end in an error reply (``ok`` false, a sensible ``error.kind``, never
``internal``) or a closed connection, never in a hang (every read has a deadline); after
each batch the daemon still serves a fresh client and the objects stored before the fuzzing
read back byte-exact (docs/architecture.md, "Bad input and failures": bad input gets a clear
error reply, the connection or the daemon survives, nothing stored is lost; the error kinds
and limits are in docs/protocol.md).
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import struct
import time
from array import array
from typing import Any, Self

import httpx
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfabric.client import Client
from kvfabric.hashing import chunk_hashes
from kvfabric.protocol.frames import HELLO_FRAME, MAX_FRAME, MAX_ITEMS, FrameDecoder
from kvfabric.protocol.messages import MAX_BATCH, MAX_KEYS, PROTOCOL_VERSION, encode_namespace
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=32, dtype="bfloat16", chunk_tokens=16)
SEED_NS = Namespace("seed-model-7f3a", SPEC, tenant_salt="seed")  # fuzzing never names it
FUZZ_NS = Namespace("fuzz-model", SPEC, tenant_salt="fuzz")
SETTINGS = [
    "store.tiers.dram.capacity=4MiB",
    "store.tiers.dram.page_size=16KiB",
    "store.tiers.ssd.capacity=64MiB",
]
REPLY_TIMEOUT = 40.0  # a reply (or the close) later than this is a hang (> any store wait)
# One daemon serves the whole module (every test adds to its abuse). Each @given runs inside
# its test and the batch ends with the integrity check; example counts keep the whole file
# well under 90 s on 2 cores.
FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
        HealthCheck.filter_too_much,
    ],
)

# Kinds a malformed request may legitimately get; "internal" (a daemon bug) never.
ENVELOPE_KINDS = {"bad_request", "unsupported_version"}
REQUEST_KINDS = ENVELOPE_KINDS | {
    "not_found",
    "exists",
    "no_capacity",
    "spec_mismatch",
    "deadline",
    "aborted",
    "lease_expired",
    "bad_spec",
    "bad_size",
}
OPS = [
    "hello",
    "lookup",
    "reserve",
    "commit",
    "abort",
    "get",
    "wait_layer",
    "release",
    "reserve_batch",
    "commit_batch",
    "get_batch",
    "release_batch",
    "contains",
    "delete",
    "stats",
    "ping",
]
BATCH_OPS = {"reserve_batch", "commit_batch", "get_batch", "release_batch"}


class Hang(AssertionError):
    pass


OMIT = object()  # leave "args" out of the request


# ---------------------------------------------------------------------- raw connection


class Raw:
    """A raw control connection: frames written by hand, replies decoded with deadlines."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(REPLY_TIMEOUT)
        self.sock.connect(path)
        self.decoder = FrameDecoder()
        self.queue: list[dict] = []
        self.ids = itertools.count(1)
        self.closed_by_peer = False
        self.arenas: dict[int, int] = {}  # tier index -> page count

    # sending ------------------------------------------------------------
    def send_bytes(self, data: bytes) -> bool:
        """False when the daemon had already closed the connection."""
        try:
            self.sock.sendall(data)
            return True
        except (BrokenPipeError, ConnectionResetError):
            return False

    def send(self, message: Any) -> bool:
        body = msgpack.packb(message, use_bin_type=True)
        self.last_size = len(body)
        return self.send_bytes(struct.pack("<I", len(body)) + body)

    def request(
        self, op: Any, args: Any = OMIT, *, v: Any = PROTOCOL_VERSION, rid: int | None = None
    ) -> int:
        rid = next(self.ids) if rid is None else rid
        message = {"v": v, "id": rid, "op": op}
        if args is not OMIT:
            message["args"] = args
        self.send(message)
        self.last_id = rid
        return rid

    # receiving ----------------------------------------------------------
    def next_message(self) -> dict | None:
        """The next frame from the daemon, or None once it closed the connection."""
        while not self.queue:
            if self.closed_by_peer:
                return None
            try:
                data, ancdata, _, _ = self.sock.recvmsg(1 << 16, socket.CMSG_SPACE(16 * 4))
            except TimeoutError:
                raise Hang(f"no reply and no close within {REPLY_TIMEOUT}s") from None
            except ConnectionResetError:
                data, ancdata = b"", []
            for level, kind, cdata in ancdata:  # arena fds of a hello reply: not mapped here
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    for fd in array("i", cdata[: len(cdata) - len(cdata) % 4]):
                        os.close(fd)
            if not data:
                self.closed_by_peer = True
                return None
            # the daemon's own frames must always decode: a ProtocolError here is a bug
            self.queue.extend(self.decoder.feed(data))
        return self.queue.pop(0)

    def reply(self, rid: int) -> dict | None:
        """The reply to ``rid`` (or a stream-level rejection, id 0); None if closed first."""
        while True:
            message = self.next_message()
            if message is None:
                return None
            assert message.get("v") == PROTOCOL_VERSION, message
            if message.get("id") == rid or (message.get("id") == 0 and message.get("ok") is False):
                return message

    def call(self, op: Any, args: Any = OMIT, **kw: Any) -> dict | None:
        return self.reply(self.request(op, args, **kw))

    def hello(self, **args: Any) -> dict:
        reply = self.call("hello", {"client": "fuzz", **args})
        assert reply is not None and reply["ok"] is True, reply
        for arena in reply["result"]["arenas"]:
            self.arenas[arena["index"]] = arena["size"] // arena["page_size"]
        return reply["result"]

    def ping_ok(self) -> bool:
        reply = self.call("ping", {})
        return reply is not None and reply.get("ok") is True and reply["result"] == "pong"

    def wait_closed(self) -> list[dict]:
        """Half-close our side, then read until the daemon closes; returns what came."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        seen = []
        while (message := self.next_message()) is not None:
            seen.append(message)
        return seen

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def assert_error(reply: dict | None, kinds: set[str] | str, *, allow_closed: bool = False) -> None:
    if isinstance(kinds, str):
        kinds = {kinds}
    if reply is None:
        assert allow_closed, "the daemon closed the connection instead of replying"
        return
    assert reply.get("ok") is False, reply
    error = reply.get("error")
    assert isinstance(error, dict) and isinstance(error.get("message"), str), reply
    assert error.get("kind") in kinds, reply


def check_pages(conn: Raw, reply: dict) -> None:
    """Page ids the daemon hands out (in a reply or a batch item) are inside the arena it
    announced."""
    result = reply["result"]
    pages = array("I")
    pages.frombytes(result["pages"])
    assert result["tier"] in conn.arenas, result
    assert len(pages) > 0 and max(pages) < conn.arenas[result["tier"]], result
    assert len(set(pages)) == len(pages)


def reply_problem(conn: Raw, op: str, reply: dict | None) -> str | None:
    """Why ``reply`` is not an acceptable answer to a request of ``op`` (None: it is): an
    error of a sensible kind, or a result whose page ids, items and types are sound."""
    if reply is None:
        return "the daemon hung up on a bad request"
    if reply.get("ok") is False:
        kind = reply.get("error", {}).get("kind")
        return None if kind in REQUEST_KINDS else f"error kind {kind!r}"
    if reply.get("ok") is not True:
        return "neither ok nor error"
    result = reply["result"]
    if op in ("reserve", "get"):
        check_pages(conn, reply)
    elif op == "contains":
        if not (isinstance(result, list) and all(isinstance(b, bool) for b in result)):
            return "contains must answer a list of bools"
    elif op in BATCH_OPS:
        if not isinstance(result, list) or not result:
            return "a batch must answer a non-empty list of items"
        for item in result:
            if item.get("ok") is True:
                if op in ("reserve_batch", "get_batch"):
                    check_pages(conn, item)
            elif item.get("error", {}).get("kind") not in REQUEST_KINDS:
                return f"batch item {item!r}"
    return None


# ---------------------------------------------------------------------- seeded data


def payload(key: bytes, nbytes: int = SPEC.chunk_bytes) -> bytes:
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    # one daemon shared by the module: every test adds to the same daemon's abuse
    process = start_module_daemon("fuzzed-node", *SETTINGS)
    process.seeded = seed(process)  # before any test of the module abuses it
    return process


@pytest.fixture
def seeded(daemon) -> dict[bytes, bytes]:
    return daemon.seeded


def seed(daemon) -> dict[bytes, bytes]:
    """Objects stored before any fuzzing: a chain of full chunks and a partial last one."""
    refs = chunk_hashes(SEED_NS, list(range(10 * SPEC.chunk_tokens + 5)))
    stored = {}
    with Client(daemon.socket) as client:
        for ref in refs:
            data = payload(ref.key, SPEC.layout(ref.num_tokens).nbytes)
            assert client.put(
                SEED_NS,
                ref.key,
                np.frombuffer(data, np.uint8),
                parent=ref.parent,
                num_tokens=ref.num_tokens,
            )
            stored[ref.key] = data
    return stored


def check_intact(daemon, seeded: dict[bytes, bytes]) -> None:
    """The daemon is up, serves a fresh client, and every seeded object is byte-exact."""
    assert daemon.proc.poll() is None, f"daemon died: {daemon.read_log()}"
    with Client(daemon.socket, timeout=REPLY_TIMEOUT, reconnect=False) as client:
        client.ping()
        keys = list(seeded)
        assert client.contains(SEED_NS, keys) == [True] * len(keys)
        for key, data in seeded.items():
            with client.get(SEED_NS, key) as reader:
                assert reader.to_bytes() == data
        assert client.lookup(SEED_NS, keys=keys).matched_chunks == len(keys)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


# ---------------------------------------------------------------------- strategies

ints = st.integers(-(1 << 63), (1 << 64) - 1) | st.sampled_from(
    [0, 1, 2, 3, -1, 15, 16, 17, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, -(1 << 63)]
)
floats = st.floats() | st.sampled_from([0.5, 1.0, 4.0, -0.0, math.nan, math.inf, -math.inf])
bins = st.binary(max_size=40) | st.sampled_from(
    [b"", b"\x00" * 15, b"\x00" * 16, b"\xff" * 16, b"\x00" * 17, b"\x01" * 64]
)
scalar_junk = st.none() | st.booleans() | ints | floats | st.text(max_size=30) | bins
junk = st.recursive(
    scalar_junk,
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(st.text(max_size=8) | st.binary(max_size=8), children, max_size=5)
    ),
    max_leaves=15,
) | st.sampled_from(
    [
        list(range(5000)),  # a long list of ints
        [b"\x00" * 16] * 3000,  # many (valid-looking) keys
        [[[[[[[[[[[[[[[[[[[[0]]]]]]]]]]]]]]]]]]]],  # nesting
        {"a": {"b": {"c": {"d": {"e": {"f": {}}}}}}},
        "x" * 5000,
        b"\x00" * 70000,
    ]
)
# A timeout that a valid request could turn into a long legitimate wait is no hang: keep
# valid timeouts short (the fuzzer must not mistake a daemon waiting as told for a hang).
timeouts = junk.filter(
    lambda v: not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0.5)
)


def ns_mutations() -> st.SearchStrategy:
    base = encode_namespace(FUZZ_NS)
    spec_fields = ["num_layers", "num_kv_heads", "head_dim", "dtype", "kind", "chunk_tokens"]

    def set_field(name, value):
        return {**base, name: value}

    def set_spec(name, value):
        return {**base, "spec": {**base["spec"], name: value}}

    def drop(name):
        return {k: v for k, v in base.items() if k != name}

    def drop_spec(name):
        return {**base, "spec": {k: v for k, v in base["spec"].items() if k != name}}

    return st.one_of(
        st.just(base),
        junk,
        st.builds(set_field, st.sampled_from(["model", "tenant", "lora", "spec"]), junk),
        st.builds(set_field, st.text(max_size=6) | st.binary(max_size=6), junk),
        st.builds(set_spec, st.sampled_from(spec_fields), junk),
        st.builds(
            set_spec,
            st.sampled_from(spec_fields),
            st.integers(-5, 1 << 20) | st.sampled_from([4.0, True, "4", 1 << 40]),
        ),
        st.builds(set_spec, st.text(max_size=6) | st.binary(max_size=6), junk),
        st.builds(drop, st.sampled_from(["model", "spec", "tenant", "lora"])),
        st.builds(drop_spec, st.sampled_from(spec_fields)),
    )


namespaces = ns_mutations()
KEY_NAMES = ["A", "B", "C", "new"]  # symbolic: resolved to this session's keys
ROOT_NAME = "ROOT"

# What each field looks like when valid ...
key_names = st.sampled_from(KEY_NAMES)
VALID_FIELDS: dict[str, st.SearchStrategy] = {
    "ns": st.just(encode_namespace(FUZZ_NS)),
    "key": key_names,
    "parent": key_names | st.just(ROOT_NAME),
    "keys": st.lists(key_names, max_size=4),
    "tokens": st.lists(st.integers(-(1 << 31), (1 << 31) - 1), max_size=40).map(
        lambda t: struct.pack(f"<{len(t)}i", *t)
    ),
    "num_tokens": st.integers(1, SPEC.chunk_tokens),
    "lease": st.sampled_from([1, 3, 1, 3, 2, 4]),  # 1: a reservation, 3: a pin, held
    "layers": st.integers(1, (1 << SPEC.num_layers) - 1),
    "layer": st.integers(0, SPEC.num_layers - 1),
    "timeout": st.floats(0, 0.3),
    "client": st.text(max_size=10),
    "token": st.none(),
    "items": st.lists(
        st.fixed_dictionaries(
            {"key": key_names},
            optional={
                "parent": key_names | st.just(ROOT_NAME),
                "num_tokens": st.integers(1, SPEC.chunk_tokens),
            },
        ),
        min_size=1,
        max_size=4,
    ),
    "leases": st.lists(st.sampled_from([1, 3, 2, 4, 5]), min_size=1, max_size=4),
}
# ... and what it looks like broken: wrong types, out of range, edge values, garbage.
edge_ints = (
    st.sampled_from(
        [
            0,
            -1,
            16,
            17,
            31,
            255,
            1 << 31,
            1 << 32,
            (1 << 63) - 1,
            1 << 63,
            (1 << 64) - 1,
            -(1 << 63),
        ]
    )
    | ints
)
int_junk = st.one_of(
    edge_ints, edge_ints, edge_ints, floats, st.booleans(), st.text(max_size=5), bins, junk
)
BROKEN_FIELDS: dict[str, st.SearchStrategy] = {
    "ns": ns_mutations(),
    "key": bins | junk,
    "parent": bins | junk,
    "keys": st.lists(bins | key_names, min_size=1, max_size=5) | st.lists(junk, max_size=4) | junk,
    "tokens": st.binary(max_size=41).filter(lambda b: len(b) % 4)
    | st.lists(ints, max_size=5)
    | junk,
    "num_tokens": int_junk,
    "lease": int_junk,
    "layers": int_junk,
    "layer": int_junk,
    "timeout": timeouts,
    "client": junk,
    "token": junk.filter(lambda v: v is not None),
    "items": st.lists(
        st.fixed_dictionaries(
            {},
            optional={
                "key": bins | junk | key_names,
                "parent": bins | junk,
                "num_tokens": int_junk,
                "extra": junk,
            },
        ),
        max_size=4,
    )
    | st.lists(junk, min_size=1, max_size=3)
    | junk
    | st.just([{"key": "A"}] * (MAX_BATCH + 1)),
    "leases": st.lists(int_junk, max_size=4) | junk | st.just([1] * (MAX_BATCH + 1)),
}
OP_FIELDS: dict[str, tuple[list[str], list[str]]] = {  # op -> (required, optional) fields
    "hello": ([], ["client", "token"]),
    "lookup": (["ns", "keys"], []),  # the tokens form is the variant below
    "lookup_tokens": (["ns", "tokens"], []),
    "reserve": (["ns", "key"], ["parent", "num_tokens"]),
    "commit": (["lease"], ["layers"]),
    "abort": (["lease"], []),
    "get": (["ns", "key"], ["timeout"]),
    "wait_layer": (["lease", "layer", "timeout"], []),  # timeout: its 30 s default is no hang
    "release": (["lease"], []),
    "reserve_batch": (["ns", "items"], []),
    "commit_batch": (["leases"], []),
    "get_batch": (["ns", "keys"], ["timeout"]),
    "release_batch": (["leases"], []),
    "contains": (["ns", "keys"], []),
    "delete": (["ns", "key"], []),
    "stats": ([], []),
    "ping": ([], []),
}


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, dict]:
    """One request: valid, or with one field broken, missing or an unknown one added."""
    name = draw(st.sampled_from(sorted(OP_FIELDS)))
    required, optional = OP_FIELDS[name]
    fields = required + [f for f in optional if draw(st.booleans())]
    args = {f: draw(VALID_FIELDS[f]) for f in fields}
    mode = draw(st.sampled_from(["valid", "broken", "broken", "broken", "two", "missing", "extra"]))
    breakable = [f for f in fields if not (f == "timeout" and name == "wait_layer")] or fields
    if mode in ("broken", "two") and breakable:
        for field in draw(
            st.lists(
                st.sampled_from(breakable),
                min_size=1,
                max_size=1 if mode == "broken" else 2,
                unique=True,
            )
        ):
            args[field] = draw(BROKEN_FIELDS[field])
    elif mode == "missing" and required:
        droppable = [f for f in required if not (f == "timeout" and name == "wait_layer")]
        if droppable:
            del args[draw(st.sampled_from(droppable))]
    elif mode == "extra":
        args[draw(st.text(max_size=6) | st.binary(max_size=6))] = draw(junk)
    return ("lookup" if name == "lookup_tokens" else name), args


def resolve(value: Any, names: dict[str, bytes]) -> Any:
    """Symbolic key names -> this session's keys, recursively."""
    if isinstance(value, str) and value in names:
        return names[value]
    if value == ROOT_NAME:
        return bytes(16)
    if isinstance(value, list):
        return [resolve(v, names) for v in value]
    if isinstance(value, dict):
        return {k: resolve(v, names) for k, v in value.items()}
    return value


# ---------------------------------------------------------------------- fuzz: frames


def test_fuzz_random_bytes_get_an_error_or_a_close(daemon, seeded) -> None:
    @FUZZ
    @given(data=st.binary(min_size=1, max_size=600), after_hello=st.booleans())
    def case(data: bytes, after_hello: bool) -> None:
        with Raw(daemon.socket) as conn:
            if after_hello:
                conn.hello()
            conn.send_bytes(data)
            for message in conn.wait_closed():  # never a hang; whatever came is an error
                assert_error(message, ENVELOPE_KINDS | {"unauthorized"})

    case()
    check_intact(daemon, seeded)


def _frame(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


frame_cases = st.one_of(
    # a plausible length, garbage msgpack behind it
    st.binary(max_size=300).map(lambda b: ("broken", _frame(b))),
    # lengths over the limit, up to 4 GiB, with a little of the "body"
    st.tuples(
        st.integers(MAX_FRAME + 1, 0xFFFFFFFF) | st.just(0xFFFFFFFF), st.binary(max_size=64)
    ).map(lambda t: ("oversize", struct.pack("<I", t[0]) + t[1])),
    # valid msgpack that is not a map
    st.one_of(
        ints,
        floats,
        st.text(max_size=20),
        bins,
        st.lists(ints, max_size=5),
        st.none(),
        st.booleans(),
    ).map(lambda v: ("not_map", _frame(msgpack.packb(v, use_bin_type=True)))),
    # a map with a broken envelope: the session survives
    st.dictionaries(
        st.sampled_from(["v", "id", "op", "args"]) | st.text(max_size=4), junk, max_size=5
    ).map(lambda m: ("envelope", _frame(msgpack.packb(m, use_bin_type=True)))),
    # a valid request cut short, then EOF
    st.tuples(st.sampled_from(OPS), st.integers(1, 30)).map(
        lambda t: (
            "truncated",
            _frame(msgpack.packb({"v": 1, "id": 9, "op": t[0], "args": {"lease": 1}}))[: -t[1]],
        )
    ),
)


def _is_valid_envelope(message: dict) -> bool:
    rid = message.get("id")
    return (
        type(message.get("v")) is int
        and message.get("v") == 1
        and type(rid) is int
        and 0 <= rid < 1 << 64
        and message.get("op") in OPS
        and isinstance(message.get("args", {}), dict)
    )


def test_fuzz_malformed_frames_after_hello(daemon, seeded) -> None:
    @FUZZ
    @given(case=frame_cases)
    def case(case: tuple[str, bytes]) -> None:
        kind, data = case
        with Raw(daemon.socket) as conn:
            conn.hello()
            conn.send_bytes(data)
            if kind == "truncated":
                # the daemon cannot know the frame is cut: it waits, and EOF ends the session
                assert conn.wait_closed() == []
            elif kind == "envelope":
                message = msgpack.unpackb(data[4:], raw=False, strict_map_key=False)
                reply = conn.next_message()
                if _is_valid_envelope(message):
                    assert reply is not None and reply["id"] == message["id"], reply
                    if reply["ok"] is False:
                        assert reply["error"]["kind"] in REQUEST_KINDS, reply
                else:
                    assert_error(reply, ENVELOPE_KINDS)
                assert conn.ping_ok(), "a bad envelope must not cost the session"
            else:
                # an error reply (the daemon may hang up before we read it), then a close
                assert_error(conn.next_message(), "bad_request", allow_closed=kind == "oversize")
                assert conn.wait_closed() == []

    case()
    check_intact(daemon, seeded)


# ---------------------------------------------------------------------- fuzz: handlers


def test_fuzz_every_op_with_wrong_arguments(daemon, seeded) -> None:
    """Requests of every op with fields missing, mistyped, out of range or extra, on a
    session that holds a reservation (lease 1) and a pin (lease 3)."""
    ns = encode_namespace(FUZZ_NS)

    @settings(FUZZ, max_examples=300)
    @given(calls=st.lists(requests(), min_size=3, max_size=15))
    def case(calls: list[tuple[str, dict]]) -> None:
        names = {
            "A": os.urandom(16),
            "B": os.urandom(16),
            "C": os.urandom(16),
            "new": os.urandom(16),
        }
        with Raw(daemon.socket) as conn:
            conn.hello()
            reserved = conn.call("reserve", {"ns": ns, "key": names["A"]})
            assert reserved["ok"] and reserved["result"]["lease"] == 1, reserved
            check_pages(conn, reserved)
            writer = conn.call("reserve", {"ns": ns, "key": names["B"]})
            assert conn.call("commit", {"lease": writer["result"]["lease"]})["result"] == {
                "done": True
            }
            pinned = conn.call("get", {"ns": ns, "key": names["B"]})
            assert pinned["ok"] and pinned["result"]["lease"] == 3, pinned
            for op, template in calls:
                args = resolve(template, names)
                reply = conn.call(op, args)
                problem = reply_problem(conn, op, reply)
                assert problem is None, f"{op} {args!r:.300}: {problem}: {reply!r:.500}"
            assert conn.ping_ok(), "the session must survive bad requests"
        assert daemon.proc.poll() is None

    case()
    check_intact(daemon, seeded)


def test_fuzz_envelope_garbage_on_a_live_session(daemon, seeded) -> None:
    @FUZZ
    @given(
        op=st.sampled_from(OPS) | junk,
        args=junk | st.just(OMIT),
        version=st.just(PROTOCOL_VERSION) | junk | st.sampled_from([0, 2, True, 1.0]),
    )
    def case(op: Any, args: Any, version: Any) -> None:
        with Raw(daemon.socket) as conn:
            conn.hello()
            reply = conn.call(op, args, v=version)
            assert reply is not None
            if type(version) is not int or version != PROTOCOL_VERSION:
                assert_error(reply, "unsupported_version")
            elif (
                op not in OPS or op == "hello" or (args is not OMIT and not isinstance(args, dict))
            ):
                assert_error(reply, "bad_request")  # (hello: only valid as the first request)
            else:
                assert reply["ok"] or reply["error"]["kind"] in REQUEST_KINDS, reply
            assert conn.ping_ok()

    case()
    check_intact(daemon, seeded)


def test_fuzz_first_request_must_be_a_valid_hello(daemon, seeded) -> None:
    @FUZZ
    @given(
        op=st.sampled_from(OPS),
        args=junk | st.just({}) | st.just(OMIT),
        version=st.just(PROTOCOL_VERSION) | junk,
    )
    def case(op: str, args: Any, version: Any) -> None:
        with Raw(daemon.socket) as conn:
            reply = conn.call(op, args, v=version)
            if conn.last_size > HELLO_FRAME:  # refused by its length alone, before hello
                assert_error(reply, "bad_request", allow_closed=True)
                assert conn.wait_closed() == []
                return
            valid_version = type(version) is int and version == PROTOCOL_VERSION
            if (
                op == "hello"
                and valid_version
                and (args is OMIT or isinstance(args, dict))
                and reply is not None
                and reply.get("ok")
            ):
                assert conn.ping_ok()  # a hello whose junk happened to be acceptable
                return
            if not valid_version:
                assert_error(reply, "unsupported_version")
            elif op != "hello" and (args is OMIT or isinstance(args, dict)):
                assert_error(reply, "unauthorized")
            else:  # a broken envelope (args not a map) may be reported as such
                assert_error(reply, {"bad_request", "unauthorized"})
            assert conn.wait_closed() == []  # no session without a hello

    case()
    check_intact(daemon, seeded)


# ---------------------------------------------------------------------- every field x value

WRONG_VALUES: list[Any] = [
    True,
    False,
    0,
    -1,
    16,
    17,
    255,
    1 << 31,
    1 << 32,
    (1 << 63) - 1,
    1 << 63,
    (1 << 64) - 1,
    -(1 << 63),
    0.0,
    1.5,
    -2.5,
    math.nan,
    math.inf,
    -math.inf,
    "",
    "A",
    "x" * 5000,
    b"",
    b"\x00" * 4,
    b"\x00" * 15,
    b"\x00" * 16,
    b"\x00" * 17,
    b"\xff" * 4096,
    [],
    [b"\x00" * 16],
    [b"\x00" * 15],
    [1, 2],
    list(range(5000)),
    [[[[[]]]]],
    {},
    {"a": {"b": [1]}},
    {b"raw": 1},
    None,
    OMIT,  # last: a commit without a mask commits every layer and ends the lease
]
INT_RANGES = {
    "lease": None,
    "layers": (1, (1 << SPEC.num_layers) - 1),
    "layer": (0, SPEC.num_layers - 1),
    "num_tokens": (1, SPEC.chunk_tokens),
}


def acceptable(op: str, field: str, value: Any) -> bool:
    """Whether ``value`` is a valid ``field`` of ``op`` (a valid request may still fail in
    the store; an invalid one must be refused as a bad request)."""
    _, optional = OP_FIELDS[op]
    if value is OMIT or value is None:  # nil stands for an absent optional field
        return field in optional or (op, field) == ("wait_layer", "timeout")  # 30 s default
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if field in INT_RANGES:
        bounds = INT_RANGES[field]
        return type(value) is int and bounds is not None and bounds[0] <= value <= bounds[1]
    if field in ("key", "parent"):
        return isinstance(value, bytes) and len(value) == 16
    if field in ("items", "leases") or (op, field) == ("get_batch", "keys"):
        return isinstance(value, list) and 0 < len(value) <= MAX_BATCH  # items: one by one
    if field == "keys":
        if isinstance(value, bytes):  # packed: keys back to back
            return len(value) % 16 == 0 and len(value) <= 16 * MAX_KEYS
        return isinstance(value, list) and all(isinstance(k, bytes) and len(k) == 16 for k in value)
    if field == "tokens":
        return isinstance(value, bytes) and len(value) % 4 == 0
    if field == "timeout":
        return value is None or (number and 0 <= value <= 600)
    raise AssertionError(field)


def item_acceptable(op: str, entry: Any) -> bool:
    """Whether one entry of a batch list is well-formed (it may still fail in the store)."""
    if op in ("commit_batch", "release_batch"):
        return type(entry) is int and 0 <= entry < 1 << 63
    if op == "get_batch":
        return isinstance(entry, bytes) and len(entry) == 16
    assert op == "reserve_batch"
    return (
        isinstance(entry, dict)
        and set(entry) <= {"key", "parent", "num_tokens"}
        and acceptable("reserve", "key", entry.get("key", OMIT))
        and acceptable("reserve", "parent", entry.get("parent", OMIT))
        and acceptable("reserve", "num_tokens", entry.get("num_tokens", OMIT))
    )


def test_every_field_of_every_op_with_each_wrong_value(daemon, seeded) -> None:
    """The systematic counterpart of the fuzzing: one field at a time takes each value of a
    catalogue (wrong types, out of range, edge sizes); invalid ones are bad requests."""
    ns = encode_namespace(FUZZ_NS)
    checked, problems = 0, []
    for op, (required, optional) in OP_FIELDS.items():
        if op in ("hello", "stats", "ping"):
            continue
        for field in required + optional:
            if field == "ns":
                continue  # namespaces have their own catalogue below
            with Raw(daemon.socket) as conn:
                conn.hello()
                names = {"A": os.urandom(16), "B": os.urandom(16)}
                if "lease" in required or "leases" in required:  # 1: reserved, 3: pinned
                    assert (
                        conn.call("reserve", {"ns": ns, "key": names["A"]})["result"]["lease"] == 1
                    )
                    conn.call(
                        "commit",
                        {
                            "lease": conn.call("reserve", {"ns": ns, "key": names["B"]})["result"][
                                "lease"
                            ]
                        },
                    )
                    assert conn.call("get", {"ns": ns, "key": names["B"]})["result"]["lease"] == 3
                base = {
                    "ns": ns,
                    "key": names["A"],
                    "parent": bytes(16),
                    "keys": [names["A"], names["B"]],
                    "tokens": b"\x00" * 64,
                    "num_tokens": SPEC.chunk_tokens,
                    "lease": 1 if op == "commit" else 3,
                    "layers": 1,
                    "layer": 0,
                    "timeout": 0.1,
                    "items": [{"key": os.urandom(16)}],
                    "leases": [1] if op == "commit_batch" else [3],
                }
                if op == "abort":
                    base["lease"] = 1
                if op == "get_batch":
                    base["keys"] = [names["A"]]
                for value in WRONG_VALUES:
                    args = {f: base[f] for f in required + optional}
                    if value is OMIT:
                        del args[field]
                    else:
                        args[field] = value
                    wire_op = "lookup" if op == "lookup_tokens" else op
                    reply = conn.call(wire_op, args)
                    context = f"{op}.{field}={value!r:.60}"
                    checked += 1
                    problem = reply_problem(conn, wire_op, reply)
                    if problem is not None:
                        problems.append((context, problem, reply))
                        continue
                    if not acceptable(op, field, value):
                        if reply["ok"] or reply["error"]["kind"] != "bad_request":
                            problems.append((context, "should be a bad request", reply))
                        continue
                    if op in BATCH_OPS and reply["ok"] and field in ("items", "leases", "keys"):
                        if len(reply["result"]) != len(value):
                            problems.append((context, "one answer per item", reply))
                        for entry, item in zip(value, reply["result"]):
                            if not item_acceptable(op, entry) and (
                                item["ok"] or item["error"]["kind"] != "bad_request"
                            ):
                                problems.append(
                                    (
                                        f"{context} item {entry!r:.40}",
                                        "should be a bad request",
                                        item,
                                    )
                                )
                    # give back what a success took, so the next value meets the same state
                    if reply["ok"] and op in ("reserve", "get"):
                        conn.call("abort", {"lease": reply["result"]["lease"]})
                    if reply["ok"] and op in ("reserve_batch", "get_batch"):
                        for item in reply["result"]:
                            if item["ok"]:
                                conn.call("abort", {"lease": item["result"]["lease"]})
                    if reply["ok"] and (
                        (op == "commit" and reply["result"]["done"]) or op == "commit_batch"
                    ):
                        break  # the reservation is gone; the rest would all be unknown
                assert conn.ping_ok(), context
    assert not problems, "\n".join(f"{c}: {p}: {r!r:.300}" for c, p, r in problems)
    assert checked > 600
    check_intact(daemon, seeded)


BROKEN_NAMESPACES: list[Any] = [
    None,
    [],
    "ns",
    1,
    b"ns",
    {},
    {"model": "m"},
    {"spec": SPEC.to_dict()},
]
for _name, _values in {
    "model": [OMIT, 1, b"m", "", "x" * 5000, None, ["m"]],
    "tenant": [1, None, b"t", "x" * 5000, ["t"]],
    "lora": [1, None, {"l": 1}, "x" * 5000],
    "spec": [OMIT, None, [], "mha", 1, {}],
    "bogus": [1, None],
    b"model": ["m"],
    b"": [1],
}.items():
    for _value in _values:
        _ns = dict(encode_namespace(FUZZ_NS))
        if _value is OMIT:
            del _ns[_name]
        else:
            _ns[_name] = _value
        BROKEN_NAMESPACES.append(_ns)
for _name, _values in {
    "num_layers": [OMIT, 0, -1, 4.0, True, "4", 1 << 40, None, 1025],
    "num_kv_heads": [OMIT, 0, 2.0, False, 1 << 64 - 1, [2]],
    "head_dim": [OMIT, -32, 32.5, "32", 65537],
    "chunk_tokens": [0, 16.0, True, (1 << 16) + 1, b"16"],
    "dtype": ["int8", 1, None, [], {"d": 1}, "x" * 5000],
    "kind": ["gqa", "mla", 1, [], None],  # mla with 2 heads is invalid too
    "extra": [1],
    b"num_layers": [4],
    b"": [None],
}.items():
    for _value in _values:
        _ns = encode_namespace(FUZZ_NS)
        _spec = dict(_ns["spec"])
        if _value is OMIT:
            del _spec[_name]
        else:
            _spec[_name] = _value
        BROKEN_NAMESPACES.append({**_ns, "spec": _spec})


def test_every_namespace_carrying_op_refuses_each_broken_namespace(daemon, seeded) -> None:
    key = os.urandom(16)
    args = {
        "lookup": {"keys": [key]},
        "lookup_tokens": {"tokens": b"\x00" * 64},
        "reserve": {"key": key},
        "get": {"key": key},
        "contains": {"keys": [key]},
        "delete": {"key": key},
    }
    problems = []
    with Raw(daemon.socket) as conn:  # this session never uses a valid namespace
        conn.hello()
        for op, rest in args.items():
            for broken in BROKEN_NAMESPACES:
                reply = conn.call("lookup" if op == "lookup_tokens" else op, {"ns": broken, **rest})
                assert reply is not None, f"{op} {broken!r:.80}: the daemon hung up"
                if reply.get("ok") is not False or reply["error"]["kind"] != "bad_request":
                    problems.append((op, broken, reply))
        assert conn.ping_ok()
    assert not problems, "\n".join(map(repr, problems))
    check_intact(daemon, seeded)


# ---------------------------------------------------------------------- explicit cases


@pytest.mark.parametrize("op", [op for op in OPS if op != "hello"])
def test_requests_before_hello_are_refused_and_the_connection_closed(daemon, op) -> None:
    with Raw(daemon.socket) as conn:
        assert_error(conn.call(op, {}), "unauthorized")
        assert conn.wait_closed() == []
    with Client(daemon.socket, reconnect=False) as client:
        client.ping()


def test_a_second_hello_is_refused_and_the_session_survives(daemon) -> None:
    with Raw(daemon.socket) as conn:
        conn.hello()
        assert_error(conn.call("hello", {"client": "again"}), "bad_request")
        assert conn.ping_ok()


@pytest.mark.parametrize("version", [0, 2, 255, -1, "1", 1.0, True, None, [1]])
def test_wrong_protocol_version(daemon, version) -> None:
    with Raw(daemon.socket) as conn:  # in hello: refused, connection closed
        assert_error(conn.call("hello", {}, v=version), "unsupported_version")
        assert conn.wait_closed() == []
    with Raw(daemon.socket) as conn:  # later: refused, session goes on
        conn.hello()
        assert_error(conn.call("ping", {}, v=version), "unsupported_version")
        assert conn.ping_ok()


@pytest.mark.parametrize("op", ["nope", "", "PING", "Hello", 7, None, b"ping", ["ping"]])
def test_unknown_ops(daemon, op) -> None:
    with Raw(daemon.socket) as conn:
        conn.hello()
        assert_error(conn.call(op, {}), "bad_request")
        assert conn.ping_ok()


@pytest.mark.parametrize("after_hello", [False, True])
@pytest.mark.parametrize("length", [0xFFFFFFFF, 1 << 31, MAX_FRAME + 1])
def test_length_prefixes_over_the_limit_are_refused_without_allocating(
    daemon, seeded, after_hello, length
) -> None:
    before = rss_kib(daemon.proc.pid)
    with Raw(daemon.socket) as conn:
        if after_hello:
            conn.hello()
        conn.send_bytes(struct.pack("<I", length) + b"\x00" * 1000)
        assert_error(conn.next_message(), "bad_request", allow_closed=True)
        assert conn.wait_closed() == []
    assert rss_kib(daemon.proc.pid) - before < 64 * 1024, "a header must not allocate its body"
    check_intact(daemon, seeded)


def test_a_frame_over_the_limit_sent_in_full_is_refused(daemon, seeded) -> None:
    body = msgpack.packb({"v": 1, "id": 1, "op": "ping", "args": {"pad": b"\x00" * MAX_FRAME}})
    assert len(body) > MAX_FRAME
    with Raw(daemon.socket) as conn:
        conn.hello()
        conn.send_bytes(_frame(body))  # the daemon may hang up before all of it is sent
        assert_error(conn.next_message(), "bad_request", allow_closed=True)
        assert conn.wait_closed() == []
    check_intact(daemon, seeded)


def test_a_frame_of_exactly_the_limit_is_served(daemon) -> None:
    pad = b"\x00" * (MAX_FRAME - 64)
    body = msgpack.packb({"v": 1, "id": 5, "op": "ping", "args": {"pad": pad}})
    body = msgpack.packb(
        {"v": 1, "id": 5, "op": "ping", "args": {"pad": pad + b"\x00" * (MAX_FRAME - len(body))}}
    )
    assert len(body) == MAX_FRAME
    with Raw(daemon.socket) as conn:
        conn.hello()
        conn.send_bytes(_frame(body))
        reply = conn.reply(5)
        assert reply is not None and reply["ok"] and reply["result"] == "pong"


def test_a_truncated_frame_blocks_only_its_own_connection(daemon, seeded) -> None:
    frame = _frame(msgpack.packb({"v": 1, "id": 1, "op": "ping", "args": {}}))
    with Raw(daemon.socket) as stuck:
        stuck.hello()
        stuck.send_bytes(frame[:-3])
        check_intact(daemon, seeded)  # others are served meanwhile
        stuck.send_bytes(frame[-3:])  # completing it later is fine: it was only slow
        assert stuck.reply(1)["result"] == "pong"
        stuck.send_bytes(frame[:5])
        assert stuck.wait_closed() == []  # EOF mid-frame ends the session quietly


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xc1",
        b"\x93\x01",
        b"\xdd\xff\xff\xff\xff",
        b"\xdf\xff\xff\xff\xff",
        b"\xdb\xff\xff\xff\xff",
        b"\xd6\xff\x00\x00\x00\x00",
        b"\x81\x01\x02",
        b"\xa2\xff\xfe",
        b"\x80\x80",
        b"\x91" * 5000 + b"\x80",
        b"\x05",
    ],
)
def test_undecodable_bodies_get_an_error_then_a_close(daemon, body) -> None:
    with Raw(daemon.socket) as conn:
        conn.hello()
        conn.send_bytes(_frame(body))
        assert_error(conn.next_message(), "bad_request")
        assert conn.wait_closed() == []


def test_item_counts_over_the_frame_limit_close_the_connection(daemon, seeded) -> None:
    too_many = msgpack.packb(
        {"v": 1, "id": 1, "op": "contains", "args": {"keys": [0] * (MAX_ITEMS + 1)}}
    )
    with Raw(daemon.socket) as conn:
        conn.hello()
        conn.send_bytes(_frame(too_many))
        assert_error(conn.next_message(), "bad_request")
        assert conn.wait_closed() == []
    check_intact(daemon, seeded)


@pytest.mark.parametrize("op", ["lookup", "contains"])
def test_huge_lists_are_bounded(daemon, seeded, op) -> None:
    ns = encode_namespace(FUZZ_NS)
    with Raw(daemon.socket) as conn:
        conn.hello()
        assert_error(
            conn.call(op, {"ns": ns, "keys": [b"\x01" * 16] * (MAX_KEYS + 1)}), "bad_request"
        )
        assert_error(conn.call(op, {"ns": ns, "keys": list(range(MAX_ITEMS - 10))}), "bad_request")
        assert_error(conn.call(op, {"ns": ns, "keys": [[b"\x01" * 16]] * 1000}), "bad_request")
        ok = conn.call(op, {"ns": ns, "keys": [b"\x01" * 16] * MAX_KEYS})  # at the limit
        assert ok["ok"], ok
        # the packed form: its size is checked before it is cut into keys
        for packed in (b"\x01" * 16 * (MAX_KEYS + 1), b"\x01" * (16 * 3 + 5), b"\x01" * 15):
            assert_error(conn.call(op, {"ns": ns, "keys": packed}), "bad_request")
        ok = conn.call(op, {"ns": ns, "keys": b"\x01" * 16 * MAX_KEYS})
        assert ok["ok"], ok
        assert conn.ping_ok()
    check_intact(daemon, seeded)


def test_packed_keys_get_the_answers_of_the_list_form(daemon, seeded) -> None:
    ns = encode_namespace(SEED_NS)
    keys = list(seeded)
    variants = [keys, [*keys[:3], bytes(16), *keys[3:]], [bytes(16)], []]
    with Raw(daemon.socket) as conn:
        conn.hello()
        for chain in variants:
            for op in ("lookup", "contains"):
                listed = conn.call(op, {"ns": ns, "keys": chain})
                packed = conn.call(op, {"ns": ns, "keys": b"".join(chain)})
                assert listed["ok"] and packed["result"] == listed["result"], (listed, packed)
        hit = conn.call("lookup", {"ns": ns, "keys": b"".join(keys)})["result"]
        assert hit["chunks"] == len(keys) and hit["tokens"] == 10 * SPEC.chunk_tokens + 5


def test_token_lookups_are_bounded(daemon) -> None:
    ns = encode_namespace(FUZZ_NS)
    with Raw(daemon.socket) as conn:
        conn.hello()
        assert_error(conn.call("lookup", {"ns": ns, "tokens": b"\x00" * 7}), "bad_request")
        assert_error(conn.call("lookup", {"ns": ns, "tokens": list(range(64))}), "bad_request")
        reply = conn.call("lookup", {"ns": ns, "tokens": b"\x00" * (4 * 1_000_000)})
        assert reply["ok"] and reply["result"]["requested_chunks"] == 1_000_000 // 16, reply
        assert conn.ping_ok()


@pytest.mark.parametrize(
    "lease",
    [
        0,
        -1,
        7,
        1 << 40,
        (1 << 63) - 1,
        1 << 63,
        (1 << 64) - 1,
        1.0,
        True,
        "1",
        b"\x01",
        None,
        [1],
        {"id": 1},
    ],
)
@pytest.mark.parametrize("op", ["commit", "abort", "release", "wait_layer"])
def test_lease_ids_out_of_range_or_mistyped(daemon, op, lease) -> None:
    with Raw(daemon.socket) as conn:
        conn.hello()
        args = {"lease": lease, "layer": 0, "timeout": 0.1}
        if lease is None:
            del args["lease"]
        assert_error(conn.call(op, args), "bad_request")
        assert conn.ping_ok()


def test_double_release_double_commit_and_abort_after_commit(daemon) -> None:
    ns = encode_namespace(FUZZ_NS)
    key = os.urandom(16)
    with Raw(daemon.socket) as conn:
        conn.hello()
        lease = conn.call("reserve", {"ns": ns, "key": key})["result"]["lease"]
        assert conn.call("commit", {"lease": lease})["result"] == {"done": True}
        assert_error(conn.call("commit", {"lease": lease}), "bad_request")
        assert_error(conn.call("abort", {"lease": lease}), "bad_request")
        pin = conn.call("get", {"ns": ns, "key": key})["result"]["lease"]
        assert conn.call("release", {"lease": pin}) == {
            "v": 1,
            "id": conn.last_id,
            "ok": True,
            "result": None,
        }
        assert_error(conn.call("release", {"lease": pin}), "bad_request")
        assert_error(conn.call("abort", {"lease": pin}), "bad_request")
        assert_error(
            conn.call("wait_layer", {"lease": pin, "layer": 0, "timeout": 0.1}), "bad_request"
        )
        # a pin is not a reservation and the other way round
        pin = conn.call("get", {"ns": ns, "key": key})["result"]["lease"]
        assert_error(conn.call("commit", {"lease": pin}), "bad_request")
        other = conn.call("reserve", {"ns": ns, "key": os.urandom(16)})["result"]["lease"]
        assert_error(
            conn.call("wait_layer", {"lease": other, "layer": 0, "timeout": 0.1}), "bad_request"
        )
        assert conn.ping_ok()
    with Client(daemon.socket) as client:  # the object survived all of it
        assert client.contains(FUZZ_NS, [key]) == [True]


def test_commit_of_someone_elses_lease_id(daemon) -> None:
    ns = encode_namespace(FUZZ_NS)
    mine, theirs = os.urandom(16), os.urandom(16)
    with (
        Raw(daemon.socket) as owner,
        Raw(daemon.socket) as intruder,
        Raw(daemon.socket) as observer,
    ):
        owner.hello(), intruder.hello(), observer.hello()
        owned = owner.call("reserve", {"ns": ns, "key": mine})["result"]["lease"]
        # the intruder holds no lease at all: the owner's id means nothing on its session
        assert_error(intruder.call("commit", {"lease": owned}), "bad_request")
        assert_error(intruder.call("abort", {"lease": owned}), "bad_request")
        assert_error(intruder.call("release", {"lease": owned}), "bad_request")
        # with a lease of its own under the same id, it commits only its own object
        own = intruder.call("reserve", {"ns": ns, "key": theirs})["result"]["lease"]
        assert own == owned
        assert intruder.call("commit", {"lease": own})["result"] == {"done": True}
        pin = observer.call("get", {"ns": ns, "key": mine})
        assert pin["ok"] and pin["result"]["ready"] == 0, pin  # still not one layer committed
        assert observer.call("release", {"lease": pin["result"]["lease"]})["ok"]
        assert owner.call("commit", {"lease": owned})["result"] == {"done": True}
        pin = observer.call("get", {"ns": ns, "key": mine})
        assert pin["result"]["ready"] == -1


def test_commit_layer_masks_outside_the_spec_are_bad_requests(daemon) -> None:
    ns = encode_namespace(FUZZ_NS)
    with Raw(daemon.socket) as conn:
        conn.hello()
        lease = conn.call("reserve", {"ns": ns, "key": os.urandom(16)})["result"]["lease"]
        for mask in (1 << SPEC.num_layers, 0xFF, (1 << 64) - 1, 0, -1, 1.0, True, "1"):
            assert_error(conn.call("commit", {"lease": lease, "layers": mask}), "bad_request")
        partial = conn.call("commit", {"lease": lease, "layers": 0b0011})["result"]
        assert partial["done"] is False and partial["lease_s"] > 0  # renewed by the progress
        assert conn.call("commit", {"lease": lease, "layers": 0b1100})["result"] == {"done": True}


def test_wait_layer_outside_the_spec_is_a_bad_request(daemon) -> None:
    ns = encode_namespace(FUZZ_NS)
    key = os.urandom(16)
    with Raw(daemon.socket) as conn:
        conn.hello()
        conn.call("reserve", {"ns": ns, "key": key})
        pin = conn.call("get", {"ns": ns, "key": key})["result"]["lease"]
        for layer in (SPEC.num_layers, -1, 1 << 40, 0.0, True, None):
            assert_error(
                conn.call("wait_layer", {"lease": pin, "layer": layer, "timeout": 0.1}),
                "bad_request",
            )
        for timeout in (-1, math.nan, math.inf, 601, True, "1"):
            assert_error(
                conn.call("wait_layer", {"lease": pin, "layer": 0, "timeout": timeout}),
                "bad_request",
            )
        assert_error(
            conn.call("wait_layer", {"lease": pin, "layer": 0, "timeout": 0.2}), "deadline"
        )
        assert conn.ping_ok()


def test_namespace_validation_is_not_bypassed_by_a_cached_namespace(daemon) -> None:
    """A session that used a namespace once must still get every later variant checked:
    extra fields, floats and bools where the spec has ints are refused every time."""
    ns = encode_namespace(
        Namespace("cached", KVSpec(num_layers=4, num_kv_heads=1, head_dim=32, chunk_tokens=16), "t")
    )
    variants = [
        {**ns, "bogus": 1},
        {**ns, "spec": {**ns["spec"], "num_layers": 4.0}},
        {**ns, "spec": {**ns["spec"], "num_kv_heads": True}},
        {**ns, "spec": {**ns["spec"], "chunk_tokens": 16.0}},
        {**ns, b"model": "cached"},
    ]
    with Raw(daemon.socket) as conn:
        conn.hello()
        for variant in variants:  # fresh: refused
            assert_error(conn.call("contains", {"ns": variant, "keys": []}), "bad_request")
        assert conn.call("contains", {"ns": ns, "keys": [b"\x00" * 16]})["result"] == [False]
        for variant in variants:  # now that the valid one is cached: still refused
            assert_error(conn.call("contains", {"ns": variant, "keys": []}), "bad_request")


@pytest.mark.parametrize(
    "field,value",
    [
        ("ns", None),
        ("ns", []),
        ("ns", "ns"),
        ("key", b"\x00" * 15),
        ("key", b"\x00" * 17),
        ("key", "k" * 16),
        ("key", None),
        ("parent", b"\x00" * 15),
        ("parent", 0),
        ("num_tokens", 0),
        ("num_tokens", 17),
        ("num_tokens", -1),
        ("num_tokens", 8.0),
        ("num_tokens", True),
        ("num_tokens", 1 << 64 - 1),
    ],
)
def test_reserve_argument_errors(daemon, field, value) -> None:
    args = {"ns": encode_namespace(FUZZ_NS), "key": os.urandom(16), field: value}
    if value is None:
        del args[field]
    with Raw(daemon.socket) as conn:
        conn.hello()
        assert_error(conn.call("reserve", args), "bad_request")
        assert conn.ping_ok()


def test_absurd_specs_are_refused_before_allocating(daemon, seeded) -> None:
    huge = Namespace(
        "huge",
        KVSpec(num_layers=1024, num_kv_heads=1024, head_dim=65536, chunk_tokens=1 << 16),
        "fuzz",
    )
    before = rss_kib(daemon.proc.pid)
    with Raw(daemon.socket) as conn:
        conn.hello()
        assert_error(
            conn.call("reserve", {"ns": encode_namespace(huge), "key": os.urandom(16)}),
            {"no_capacity", "bad_request"},
        )
        assert conn.ping_ok()
    assert rss_kib(daemon.proc.pid) - before < 64 * 1024
    check_intact(daemon, seeded)


def test_pages_named_by_the_daemon_are_inside_its_arenas(daemon, seeded) -> None:
    ns = encode_namespace(SEED_NS)
    with Raw(daemon.socket) as conn:
        conn.hello()
        for key in seeded:
            reply = conn.call("get", {"ns": ns, "key": key})
            check_pages(conn, reply)
            assert conn.call("release", {"lease": reply["result"]["lease"]})["ok"]


def test_zz_after_everything_the_daemon_is_up_and_the_seeded_data_intact(daemon, seeded) -> None:
    """Last in the module: the same daemon took every case above."""
    check_intact(daemon, seeded)
    with Client(daemon.socket, reconnect=False) as client:
        stats = client.stats()
        assert stats["tiers"][-1]["corrupt_records"] == 0
        # the fuzz sessions all ended holding unfinished reservations: each was given back
        assert stats["aborted_writes"] > 100
    # and every session the fuzzing opened is gone
    deadline = time.monotonic() + 10
    while (
        sessions := httpx.get(f"{daemon.http_url}/v1/stats", timeout=10).json()["sessions"]
    ) != 0:
        assert time.monotonic() < deadline, f"{sessions} sessions still open"
        time.sleep(0.05)
