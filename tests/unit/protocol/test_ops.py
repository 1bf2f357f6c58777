"""The op table (:mod:`kvfabric.protocol.ops`) says what the daemon really does.

Every field a handler reads from a request, followed through the functions it calls (see
``tests/support/args_reads.py``), is listed in the table for that op, and no other; who may
send each op, whether it is local-only and whether it answers per item match the handlers;
every error kind the table names exists. docs/protocol.md is generated from this table
(``tests/unit/protocol/test_doc.py``), so what it documents cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
from args_reads import Functions, Unfollowable, fields_read

from kvfabric.config import AuthConfig
from kvfabric.errors import ForbiddenError, KVFabricError
from kvfabric.protocol import messages
from kvfabric.protocol.messages import Op
from kvfabric.protocol.ops import COMMON_ERRORS, OP_SPECS, OPS, Access, OpSpec, field_paths
from kvfabric.server import handlers, slices
from kvfabric.server.handlers import HANDLERS, Context
from kvfabric.server.session import Session

FUNCTIONS = Functions.of(handlers, messages, slices)
# hello is answered by the control server before a session exists, not through HANDLERS
HANDLER_NAMES = {Op.HELLO: "hello", **{op: h.fn.__name__ for op, h in HANDLERS.items()}}
# large lookups and contains are answered a slice at a time (kvfabric.server.slices)
SLICED = {Op.LOOKUP: ("_lookup", "is_large"), Op.CONTAINS: ("_contains",)}


def drift(spec: OpSpec) -> tuple[set[str], set[str]]:
    """(fields the handler reads that the table omits, fields the table lists that it
    does not read)."""
    read = fields_read(FUNCTIONS, HANDLER_NAMES[spec.op])
    listed = field_paths(spec)
    return read - listed, listed - read


def test_every_op_has_one_entry() -> None:
    assert sorted(spec.op.value for spec in OPS) == sorted(op.value for op in Op)
    assert set(HANDLER_NAMES) == set(Op)


@pytest.mark.parametrize("op", list(Op), ids=lambda op: op.value)
def test_the_table_lists_exactly_the_fields_the_handler_reads(op: Op) -> None:
    missing, unread = drift(OP_SPECS[op])
    assert not missing, f"{op.value} reads {sorted(missing)}: add them to kvfabric/protocol/ops.py"
    assert not unread, f"{op.value} never reads {sorted(unread)}: drop them from the table"


@pytest.mark.parametrize("op", sorted(SLICED), ids=lambda op: op.value)
def test_sliced_answers_read_no_field_the_table_omits(op: Op) -> None:
    read: set[str] = set()
    for name in SLICED[op]:
        read |= fields_read(FUNCTIONS, name)
    assert read <= field_paths(OP_SPECS[op])


def test_a_field_dropped_from_the_table_is_caught() -> None:
    """Negative control: the check above fails when the table omits a field."""
    reserve = OP_SPECS[Op.RESERVE]
    without_heads = tuple(f for f in reserve.fields if f.name != "heads")
    assert drift(dataclasses.replace(reserve, fields=without_heads)) == ({"heads"}, set())

    batch = OP_SPECS[Op.RESERVE_BATCH]
    items = next(f for f in batch.fields if f.name == "items")
    fewer = dataclasses.replace(items, items=tuple(i for i in items.items if i.name != "parent"))
    changed = tuple(fewer if f.name == "items" else f for f in batch.fields)
    assert drift(dataclasses.replace(batch, fields=changed)) == ({"items[].parent"}, set())


SYNTHETIC = """
def handler(ctx, session, args):
    session.namespace(args.get("ns"))
    if "alpha" in args:
        arg_int(args, "beta")
    checked(args)
    return [_item(_one, ctx, session, None, (item, 1)) for item in arg_list(args, "things")]

def checked(args, name="gamma"):
    return args[name]

def _one(ctx, session, ns, item):
    raw, _ = item
    return raw.get("delta")

def arg_int(args, name):
    return args.get(name)

def arg_list(args, name):
    return args.get(name)

def opaque(args):
    return somewhere_else(args)

def dynamic(args, field):
    return args.get(field.lower())
"""


def test_the_analysis_follows_calls_defaults_tuples_and_batch_items() -> None:
    functions = Functions()
    functions.add_source(SYNTHETIC)
    assert fields_read(functions, "handler") == {
        "ns",
        "alpha",
        "beta",
        "gamma",
        "things",
        "things[].delta",
    }


@pytest.mark.parametrize("name", ["opaque", "dynamic"])
def test_the_analysis_refuses_what_it_cannot_follow(name: str) -> None:
    functions = Functions()
    functions.add_source(SYNTHETIC)
    with pytest.raises(Unfollowable):
        fields_read(functions, name)


@pytest.mark.parametrize("op", list(HANDLERS), ids=lambda op: op.value)
def test_local_only_ops_match_the_handlers(op: Op) -> None:
    assert OP_SPECS[op].local == HANDLERS[op].local


def _refused(op: Op, *, tenant: str | None, read_only: bool) -> bool:
    """Whether the handler refuses this session (before it looks at the request)."""
    session = Session(local=True, max_leases=4)
    session.authenticate(tenant, "test", read_only=read_only)
    ctx = Context(store=None, auth=AuthConfig(), node_id="n", max_leases=4)  # type: ignore[arg-type]
    try:
        HANDLERS[op].fn(ctx, session, {})
    except ForbiddenError:
        return True
    except Exception:  # the empty request, the missing store: anything but a refusal
        return False
    return False


@pytest.mark.parametrize("op", list(HANDLERS), ids=lambda op: op.value)
def test_who_may_send_each_op_matches_the_handlers(op: Op) -> None:
    access = OP_SPECS[op].access
    assert _refused(op, tenant="t", read_only=False) == (access is Access.ADMIN)
    assert _refused(op, tenant=None, read_only=True) == (access is Access.WRITER)


@pytest.mark.parametrize("op", list(HANDLERS), ids=lambda op: op.value)
def test_per_item_answers_match_the_handlers(op: Op) -> None:
    returns = inspect.signature(HANDLERS[op].fn).return_annotation
    assert OP_SPECS[op].batch == (returns == "list[dict[str, Any]]")


def _kinds(cls: type[KVFabricError]) -> set[str]:
    out = {cls.kind}
    for sub in cls.__subclasses__():
        out |= _kinds(sub)
    return out


@pytest.mark.parametrize("spec", OPS, ids=lambda spec: spec.op.value)
def test_every_error_kind_named_exists(spec: OpSpec) -> None:
    kinds: Any = _kinds(KVFabricError)
    assert set(spec.errors) <= kinds
    assert set(COMMON_ERRORS) <= kinds
