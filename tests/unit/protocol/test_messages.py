"""Request envelopes and argument validators of the control protocol.

Every validator either returns a value within its documented contract or raises
``ProtocolError`` naming the field: never another exception type (which the daemon would
report as an internal error), whatever the peer sent.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfabric import hashing
from kvfabric.errors import (
    AuthError,
    KVFabricError,
    LeaseExpiredError,
    NotFoundError,
    ProtocolError,
    SpecError,
    UnsupportedVersionError,
    error_for_kind,
)
from kvfabric.hashing import KEY_BYTES
from kvfabric.protocol.messages import (
    MAX_BATCH,
    MAX_KEYS,
    MAX_STRING,
    MAX_TIMEOUT_S,
    MAX_TOKENS,
    PROTOCOL_VERSION,
    Op,
    arg_float,
    arg_int,
    arg_key,
    arg_keys,
    arg_list,
    arg_str,
    arg_tokens,
    decode_namespace,
    encode_namespace,
    error_reply,
    item_error,
    item_ok,
    ok_reply,
    pack_keys,
    parse_request,
    request,
    request_id_of,
)
from kvfabric.spec import KVSpec, Namespace

SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=16, dtype="float16", chunk_tokens=16)
NS = Namespace("model-a", SPEC, tenant_salt="t1", lora_id="l0")
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

garbage = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.binary(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


# ---------------------------------------------------------------------- envelope


@pytest.mark.parametrize("op", list(Op))
def test_request_round_trips_through_parse_request(op) -> None:
    args = {"x": 1}
    assert parse_request(request(7, op, args)) == (7, op, args)


def test_missing_args_means_no_args() -> None:
    assert parse_request({"v": PROTOCOL_VERSION, "id": 1, "op": "ping"}) == (1, Op.PING, {})


@pytest.mark.parametrize("bad_id", [None, -1, 1 << 64, 1.0, True, False, "1", b"1", [1], {}])
def test_request_ids_must_be_unsigned_64_bit_integers(bad_id) -> None:
    message = {"v": PROTOCOL_VERSION, "id": bad_id, "op": "ping", "args": {}}
    if bad_id is None:
        del message["id"]
    with pytest.raises(ProtocolError, match="id"):
        parse_request(message)
    assert request_id_of(message) == 0


@pytest.mark.parametrize("request_id", [0, 1, (1 << 64) - 1])
def test_extreme_valid_ids_are_kept(request_id) -> None:
    message = request(request_id, Op.PING, {})
    assert parse_request(message)[0] == request_id
    assert request_id_of(message) == request_id


@pytest.mark.parametrize("version", [None, 0, 2, -1, "1", 1.5, True, [1]])
def test_other_protocol_versions_are_refused_with_their_own_kind(version) -> None:
    message = {"v": version, "id": 5, "op": "ping", "args": {}}
    if version is None:
        del message["v"]
    with pytest.raises(UnsupportedVersionError) as caught:
        parse_request(message)
    assert caught.value.kind == "unsupported_version"
    assert isinstance(caught.value, ProtocolError)  # still a bad request for generic handlers


@pytest.mark.parametrize("op", ["nope", "", "HELLO", None, 1, b"ping", ["ping"], {"op": 1}])
def test_unknown_ops_are_protocol_errors(op) -> None:
    with pytest.raises(ProtocolError, match="unknown op"):
        parse_request({"v": PROTOCOL_VERSION, "id": 1, "op": op, "args": {}})


@pytest.mark.parametrize("args", [[], "x", 1, b"", None, True])
def test_args_must_be_a_map(args) -> None:
    with pytest.raises(ProtocolError, match="args"):
        parse_request({"v": PROTOCOL_VERSION, "id": 1, "op": "ping", "args": args})


@FAST
@given(st.dictionaries(st.text(max_size=5) | st.binary(max_size=5), garbage, max_size=5))
def test_parse_request_raises_only_protocol_errors(message) -> None:
    try:
        request_id, op, args = parse_request(message)
    except ProtocolError:
        return
    assert isinstance(op, Op) and isinstance(args, dict) and 0 <= request_id < 1 << 64


@FAST
@given(garbage)
def test_request_id_of_never_raises(message) -> None:
    rid = request_id_of(message)
    assert isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < 1 << 64


def test_replies_have_the_documented_shape() -> None:
    assert ok_reply(3, "pong") == {"v": PROTOCOL_VERSION, "id": 3, "ok": True, "result": "pong"}
    reply = error_reply(4, NotFoundError("gone"))
    assert reply == {
        "v": PROTOCOL_VERSION,
        "id": 4,
        "ok": False,
        "error": {"kind": "not_found", "message": "gone"},
    }


def test_error_messages_are_truncated_but_keep_their_kind() -> None:
    reply = error_reply(1, ProtocolError("x" * (10 * MAX_STRING)))
    assert reply["error"]["kind"] == "bad_request"
    assert len(reply["error"]["message"]) == MAX_STRING


@pytest.mark.parametrize(
    "error",
    [
        ProtocolError("a"),
        UnsupportedVersionError("b"),
        AuthError("c"),
        LeaseExpiredError("d"),
        NotFoundError("e"),
    ],
)
def test_error_kinds_rebuild_the_same_exception_type(error) -> None:
    rebuilt = error_for_kind(error.kind, str(error))
    assert type(rebuilt) is type(error) and str(rebuilt) == str(error)


def test_unknown_error_kinds_rebuild_a_base_error_with_that_kind() -> None:
    rebuilt = error_for_kind("from_the_future", "m")
    assert type(rebuilt) is KVFabricError and rebuilt.kind == "from_the_future"


# ---------------------------------------------------------------------- scalar validators


@pytest.mark.parametrize(
    "value", [True, False, 1.0, 2.5, "3", b"3", [3], {"v": 3}, -1, 1 << 63, 1 << 64]
)
def test_arg_int_refuses_non_integers_bools_and_out_of_range(value) -> None:
    with pytest.raises(ProtocolError, match="lease"):
        arg_int({"lease": value}, "lease")


def test_arg_int_bounds_default_and_missing() -> None:
    assert arg_int({"n": 0}, "n") == 0
    assert arg_int({"n": (1 << 63) - 1}, "n") == (1 << 63) - 1
    assert arg_int({"n": 5}, "n", low=5, high=5) == 5
    with pytest.raises(ProtocolError):
        arg_int({"n": 6}, "n", low=5, high=5)
    assert arg_int({}, "n", default=9) == 9
    with pytest.raises(ProtocolError, match="missing"):
        arg_int({}, "n")
    with pytest.raises(ProtocolError, match="missing"):
        arg_int({"n": None}, "n")


@pytest.mark.parametrize(
    "value",
    [
        True,
        -0.001,
        -1,
        MAX_TIMEOUT_S + 0.001,
        math.inf,
        -math.inf,
        math.nan,
        "1",
        b"1",
        [1.0],
        {"t": 1},
    ],
)
def test_arg_float_refuses_bad_timeouts(value) -> None:
    with pytest.raises(ProtocolError, match="timeout"):
        arg_float({"timeout": value}, "timeout")


def test_arg_float_accepts_ints_and_floats_in_range_and_none() -> None:
    assert arg_float({"timeout": 0}, "timeout") == 0.0
    assert isinstance(arg_float({"timeout": 3}, "timeout"), float)
    assert arg_float({"timeout": MAX_TIMEOUT_S}, "timeout") == MAX_TIMEOUT_S
    assert arg_float({}, "timeout") is None
    assert arg_float({}, "timeout", default=2.0) == 2.0


@pytest.mark.parametrize(
    "value", [None, 1, 1.0, True, b"abc", ["a"], {"a": 1}, "x" * (MAX_STRING + 1)]
)
def test_arg_str_refuses_non_strings_and_long_strings(value) -> None:
    with pytest.raises(ProtocolError, match="client"):
        arg_str({"client": value}, "client")


def test_arg_str_default_and_limit() -> None:
    assert arg_str({}, "client", default="") == ""
    assert arg_str({"client": "x" * MAX_STRING}, "client") == "x" * MAX_STRING


@pytest.mark.parametrize(
    "value",
    [
        None,
        b"",
        b"\x00" * (KEY_BYTES - 1),
        b"\x00" * (KEY_BYTES + 1),
        "a" * KEY_BYTES,
        [0] * KEY_BYTES,
        KEY_BYTES,
        1.5,
        True,
    ],
)
def test_arg_key_must_be_exactly_16_bytes(value) -> None:
    with pytest.raises(ProtocolError, match="key"):
        arg_key({"key": value}, "key")


def test_arg_key_accepts_16_bytes() -> None:
    assert arg_key({"key": b"\x01" * KEY_BYTES}, "key") == b"\x01" * KEY_BYTES


@pytest.mark.parametrize(
    "value",
    [
        None,
        b"\x00" * (KEY_BYTES - 1),
        b"\x00" * (KEY_BYTES + 1),
        bytearray(KEY_BYTES),
        "keys",
        "k" * KEY_BYTES,
        {"k": 1},
        3,
        [b"\x00" * 15],
        [b"\x00" * KEY_BYTES, None],
        [b"\x00" * KEY_BYTES, "a" * KEY_BYTES],
        [b"\x00" * KEY_BYTES, bytearray(KEY_BYTES)],
        [b"\x00" * 15, b"\x00" * 17],
        [[b"\x00" * KEY_BYTES]],
    ],
)
def test_arg_keys_refuses_anything_but_a_list_of_keys_or_packed_keys(value) -> None:
    with pytest.raises(ProtocolError, match="keys"):
        arg_keys({"keys": value})


def test_arg_keys_bounds_the_count() -> None:
    key = b"\x02" * KEY_BYTES
    assert arg_keys({"keys": []}) == []
    assert len(arg_keys({"keys": [key] * MAX_KEYS})) == MAX_KEYS
    with pytest.raises(ProtocolError, match="at most"):
        arg_keys({"keys": [key] * (MAX_KEYS + 1)})
    assert len(arg_keys({"keys": key * MAX_KEYS})) == MAX_KEYS
    with pytest.raises(ProtocolError, match="at most"):
        arg_keys({"keys": key * (MAX_KEYS + 1)})


@pytest.fixture(params=["compiled", "python"])
def key_packing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """pack_keys by the compiled join (where the install built it) and by Python."""
    if request.param == "compiled" and hashing.join_keys is None:
        pytest.skip("the C kernel was not built")
    if request.param == "python":
        monkeypatch.setattr(hashing, "join_keys", None)
    return str(request.param)


def test_packed_keys_are_the_list_form_back_to_back(key_packing: str) -> None:
    # zero bytes at either end survive (a fixed-width bytes dtype would strip trailing ones)
    keys = [bytes(KEY_BYTES), b"\x00" * 15 + b"\x01", b"\x01" + b"\x00" * 15, b"\xff" * KEY_BYTES]
    packed = pack_keys(keys)
    assert packed == b"".join(keys)
    assert arg_keys({"keys": packed}) == keys
    assert arg_keys({"keys": b""}) == [] and pack_keys([]) == b""
    assert all(type(k) is bytes for k in arg_keys({"keys": packed}))


@FAST
@given(st.lists(st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES), max_size=40))
def test_packed_and_listed_keys_decode_alike(keys) -> None:
    assert arg_keys({"keys": pack_keys(keys)}) == arg_keys({"keys": keys}) == keys
    assert pack_keys(tuple(keys)) == pack_keys(keys)


@pytest.mark.parametrize(
    "keys",
    [
        [b"\x00" * 15],
        [b"\x00" * 15, b"\x00" * 17],
        [bytes(KEY_BYTES), b"\x00" * 17],
        ["k" * KEY_BYTES],
        [None],
        [3],
    ],
)
def test_pack_keys_refuses_keys_of_the_wrong_size_or_type(keys, key_packing: str) -> None:
    with pytest.raises(SpecError, match="16 bytes"):
        pack_keys(keys)


def test_pack_keys_takes_bytes_like_keys(key_packing: str) -> None:
    keys = [bytearray(KEY_BYTES), memoryview(b"\x01" * KEY_BYTES)]
    assert pack_keys(keys) == bytes(KEY_BYTES) + b"\x01" * KEY_BYTES


@pytest.mark.parametrize(
    "value", [None, [1, 2, 3], "abcd", b"abc", b"\x00" * 5, 7, b"\x00" * (4 * MAX_TOKENS + 4)]
)
def test_arg_tokens_must_be_int32_bytes_within_the_limit(value) -> None:
    with pytest.raises(ProtocolError, match="tokens"):
        arg_tokens({"tokens": value})


def test_arg_tokens_accepts_whole_int32s() -> None:
    assert arg_tokens({"tokens": b""}) == b""
    assert len(arg_tokens({"tokens": b"\x00" * (4 * MAX_TOKENS)})) == 4 * MAX_TOKENS


@pytest.mark.parametrize(
    "value", [None, [], (), "items", b"xx", {"a": 1}, 3, True, [0] * (MAX_BATCH + 1)]
)
def test_arg_list_wants_a_non_empty_bounded_list(value) -> None:
    with pytest.raises(ProtocolError, match="items"):
        arg_list({"items": value}, "items")


def test_arg_list_accepts_up_to_the_batch_limit_of_anything() -> None:
    assert arg_list({"items": [None]}, "items") == [None]  # items are checked one by one
    assert len(arg_list({"items": [{}] * MAX_BATCH}, "items")) == MAX_BATCH


def test_batch_items_have_the_documented_shape() -> None:
    assert item_ok({"lease": 1}) == {"ok": True, "result": {"lease": 1}}
    error = item_error(LeaseExpiredError("x" * (2 * MAX_STRING)))
    assert error["ok"] is False and error["error"]["kind"] == "lease_expired"
    assert len(error["error"]["message"]) == MAX_STRING


@FAST
@given(garbage, st.sampled_from(["int", "float", "str", "key", "keys", "tokens", "list"]))
def test_validators_raise_only_protocol_errors(value, which) -> None:
    args = {"a": value}
    validator = {
        "int": lambda: arg_int(args, "a"),
        "float": lambda: arg_float(args, "a"),
        "str": lambda: arg_str(args, "a"),
        "key": lambda: arg_key(args, "a"),
        "keys": lambda: arg_keys(args, "a"),
        "tokens": lambda: arg_tokens(args, "a"),
        "list": lambda: arg_list(args, "a"),
    }
    try:
        result = validator[which]()
    except ProtocolError:
        return
    if which == "int":
        assert type(result) is int and 0 <= result < 1 << 63
    elif which == "float":
        assert result is None or (type(result) is float and 0 <= result <= MAX_TIMEOUT_S)
    elif which == "str":
        assert isinstance(result, str) and len(result) <= MAX_STRING
    elif which == "key":
        assert isinstance(result, bytes) and len(result) == KEY_BYTES
    elif which == "keys":
        assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in result)
    elif which == "list":
        assert isinstance(result, list) and 0 < len(result) <= MAX_BATCH
    else:
        assert isinstance(result, bytes) and len(result) % 4 == 0


# ---------------------------------------------------------------------- namespaces


def test_namespace_round_trips() -> None:
    assert decode_namespace(encode_namespace(NS)) == NS


def test_namespace_tenant_and_lora_default_to_empty() -> None:
    ns = decode_namespace({"model": "m", "spec": SPEC.to_dict()})
    assert (ns.tenant_salt, ns.lora_id) == ("", "")


def _ns(**changes):
    raw = encode_namespace(NS)
    for name, value in changes.items():
        if value is KeyError:
            raw.pop(name)
        else:
            raw[name] = value
    return raw


def _spec(**changes):
    spec = SPEC.to_dict()
    for name, value in changes.items():
        if value is KeyError:
            spec.pop(name)
        else:
            spec[name] = value
    return _ns(spec=spec)


@pytest.mark.parametrize(
    "raw",
    [
        None,
        [],
        "ns",
        1,
        b"ns",
        _ns(model=KeyError),
        _ns(model=1),
        _ns(model=b"m"),
        _ns(model="x" * (MAX_STRING + 1)),
        _ns(model=""),
        _ns(tenant=1),
        _ns(tenant=None),
        _ns(lora=["l"]),
        _ns(spec=KeyError),
        _ns(spec=[1, 2]),
        _ns(spec="mha"),
        _ns(extra=1),
        {**_ns(), b"model": "m"},
        _spec(num_layers=KeyError),
        _spec(num_layers=0),
        _spec(num_layers=-4),
        _spec(num_layers=4.0),
        _spec(num_layers=True),
        _spec(num_layers="4"),
        _spec(num_layers=1 << 40),
        _spec(num_kv_heads=2.5),
        _spec(head_dim=None),
        _spec(head_dim=1 << 20),
        _spec(chunk_tokens=0),
        _spec(chunk_tokens=False),
        _spec(chunk_tokens=(1 << 16) + 1),
        _spec(dtype="int8"),
        _spec(dtype=1),
        _spec(dtype=[]),
        _spec(dtype={"a": 1}),
        _spec(kind="gqa"),
        _spec(kind=[1]),
        _spec(kind={}),
        _spec(kind="mla"),  # mla with 2 heads
        _spec(extra_field=1),
        {**_ns(), "spec": {**SPEC.to_dict(), b"raw": 1, "text": 2}},
        {**_ns(), "spec": {**SPEC.to_dict(), b"num_layers": 4}},
    ],
)
def test_bad_namespaces_are_protocol_errors(raw) -> None:
    with pytest.raises(ProtocolError):
        decode_namespace(raw)


@FAST
@given(garbage)
def test_decode_namespace_raises_only_protocol_errors_on_garbage(raw) -> None:
    try:
        ns = decode_namespace(raw)
    except ProtocolError:
        return
    assert isinstance(ns, Namespace)


spec_fields = st.fixed_dictionaries(
    {},
    optional={
        "num_layers": garbage | st.integers(-3, 2000),
        "num_kv_heads": garbage | st.integers(-3, 2000),
        "head_dim": garbage | st.integers(-3, 70000),
        "dtype": garbage | st.sampled_from(["bfloat16", "fp16", "float8_e4m3fn", "x"]),
        "kind": garbage | st.sampled_from(["mha", "mla", "MHA"]),
        "chunk_tokens": garbage | st.integers(-3, 70000),
    },
)


@FAST
@given(
    spec_fields, st.dictionaries(st.text(max_size=6) | st.binary(max_size=6), garbage, max_size=2)
)
def test_decode_namespace_raises_only_protocol_errors_on_near_valid_specs(spec, extra) -> None:
    """Specs close to valid reach KVSpec's own checks: those must surface as ProtocolError."""
    try:
        ns = decode_namespace({"model": "m", "spec": {**spec, **extra}, "tenant": "t"})
    except ProtocolError:
        return
    assert isinstance(ns.spec, KVSpec)
    assert ns.spec.to_dict() == KVSpec.from_dict(dict(spec, **extra)).to_dict()
