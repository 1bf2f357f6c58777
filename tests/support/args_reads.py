"""Which request fields a handler reads, found in its source (no daemon, no store).

:func:`fields_read` follows a handler's ``args`` parameter through the functions of the
modules given (the handlers, the validators of :mod:`kvfabric.protocol.messages`) and
collects every key read from it: ``args.get(K)``, ``args[K]``, ``K in args``, and the
validators' ``name`` (``arg_int(args, "lease")``, ``arg_keys(args)`` reading ``keys``).
Entries of a list field (``for item in arg_list(args, "items")``) are followed too, also when
packed into a tuple or handed to a batch helper (``_item(fn, ctx, session, ns, item)`` calls
``fn(ctx, session, ns, item)``); their keys come back as ``items[].key``.

A key it cannot resolve to a string, or ``args`` handed to a function it cannot see, is an
:class:`Unfollowable` error rather than a silent gap: the analysis then needs teaching.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass, field
from types import ModuleType

_BATCH_HELPER = "_item"  # _item(fn, *rest) calls fn(*rest)
_LIST_VALIDATOR = "arg_list"  # its entries may be maps (arg_keys' are bins)
_HARMLESS = {"isinstance", "len", "type"}  # builtins that may look at args itself

Tracked = str | tuple["Tracked | None", ...]  # a map's path prefix, or a tuple of them


class Unfollowable(Exception):
    """The analysis met a read or a call it cannot resolve."""


@dataclass
class Functions:
    defs: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)

    @classmethod
    def of(cls, *modules: ModuleType) -> Functions:
        out = cls()
        for module in modules:
            out.add_source(inspect.getsource(module))
        return out

    def add_source(self, source: str) -> None:
        for node in ast.parse(source).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.name in self.defs:
                    raise Unfollowable(f"two functions named {node.name}")
                self.defs[node.name] = node


def fields_read(functions: Functions, name: str, param: str = "args") -> set[str]:
    """The fields function ``name`` reads from its parameter ``param``."""
    return _Reader(functions).reads(name, {param: ""}, {})


class _Reader:
    def __init__(self, functions: Functions) -> None:
        self._functions = functions
        self._active: set[tuple[str, str]] = set()

    def reads(self, name: str, tracked: dict[str, Tracked], consts: dict[str, str]) -> set[str]:
        key = (name, repr(sorted(tracked.items())) + repr(sorted(consts.items())))
        if key in self._active:  # recursion: what it reads is being collected already
            return set()
        self._active.add(key)
        try:
            return self._reads(self._functions.defs[name], dict(tracked), consts)
        finally:
            self._active.discard(key)

    def _reads(
        self,
        fn: ast.FunctionDef | ast.AsyncFunctionDef,
        tracked: dict[str, Tracked],
        consts: dict[str, str],
    ) -> set[str]:
        nodes = list(ast.walk(fn))
        for node in nodes:  # bindings first: loop variables and tuple unpacking
            self._bind(node, tracked, consts)
        out: set[str] = set()
        for node in nodes:
            out |= self._node_reads(node, tracked, consts)
        return out

    def _bind(self, node: ast.AST, tracked: dict[str, Tracked], consts: dict[str, str]) -> None:
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
            entry = self._list_field(node.iter, tracked, consts)
            if entry is not None:
                tracked[node.target.id] = entry
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
            value = tracked.get(node.value.id)
            target = node.targets[0]
            if isinstance(value, tuple) and isinstance(target, ast.Tuple):
                for element, part in zip(target.elts, value):
                    if isinstance(element, ast.Name) and part is not None:
                        tracked[element.id] = part

    def _list_field(
        self, node: ast.expr, tracked: dict[str, Tracked], consts: dict[str, str]
    ) -> str | None:
        """``arg_list(args, "items")`` -> ``items[].`` (entries of a list field)."""
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            return None
        if node.func.id != _LIST_VALIDATOR or len(node.args) < 2:
            return None
        prefix = self._prefix(node.args[0], tracked)
        if prefix is None:
            return None
        return f"{prefix}{self._key(node.args[1], consts)}[]."

    def _node_reads(
        self, node: ast.AST, tracked: dict[str, Tracked], consts: dict[str, str]
    ) -> set[str]:
        if isinstance(node, ast.Subscript):
            prefix = self._prefix(node.value, tracked)
            if prefix is not None:
                return {prefix + self._key(node.slice, consts)}
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            prefix = self._prefix(node.comparators[0], tracked)
            if prefix is not None:
                return {prefix + self._key(node.left, consts)}
        elif isinstance(node, ast.Call):
            return self._call_reads(node, tracked, consts)
        return set()

    def _call_reads(
        self, node: ast.Call, tracked: dict[str, Tracked], consts: dict[str, str]
    ) -> set[str]:
        func = node.func
        if isinstance(func, ast.Attribute):
            prefix = self._prefix(func.value, tracked)
            if prefix is not None and func.attr == "get":
                return {prefix + self._key(node.args[0], consts)}
            if prefix is not None:
                raise Unfollowable(f"line {node.lineno}: args.{func.attr}()")
        arguments = list(node.args)
        if isinstance(func, ast.Name) and func.id == _BATCH_HELPER:
            func, arguments = arguments[0], arguments[1:]
        passed = [self._tracked(a, tracked) for a in arguments]
        kw_passed = {k.arg: self._tracked(k.value, tracked) for k in node.keywords if k.arg}
        if all(p is None for p in [*passed, *kw_passed.values()]):
            return set()
        name = func.id if isinstance(func, ast.Name) else ast.unparse(func)
        if name in _HARMLESS:
            return set()
        callee = self._functions.defs.get(name)
        if callee is None:
            raise Unfollowable(f"line {node.lineno}: args handed to {name}(), not followed")
        params = [a.arg for a in callee.args.posonlyargs + callee.args.args]
        params += [a.arg for a in callee.args.kwonlyargs]
        callee_tracked: dict[str, Tracked] = {}
        callee_consts = _string_defaults(callee)
        for param, argument, value in zip(params, arguments, passed):
            self._pass(param, argument, value, consts, callee_tracked, callee_consts)
        for keyword in node.keywords:
            if keyword.arg is not None:
                value = kw_passed[keyword.arg]
                self._pass(keyword.arg, keyword.value, value, consts, callee_tracked, callee_consts)
        return self.reads(name, callee_tracked, callee_consts)

    @staticmethod
    def _pass(
        param: str,
        argument: ast.expr,
        value: Tracked | None,
        consts: dict[str, str],
        callee_tracked: dict[str, Tracked],
        callee_consts: dict[str, str],
    ) -> None:
        if value is not None:
            callee_tracked[param] = value
        elif isinstance(argument, ast.Constant) and isinstance(argument.value, str):
            callee_consts[param] = argument.value
        elif isinstance(argument, ast.Name) and argument.id in consts:
            callee_consts[param] = consts[argument.id]

    @staticmethod
    def _prefix(node: ast.expr, tracked: dict[str, Tracked]) -> str | None:
        if isinstance(node, ast.Name):
            value = tracked.get(node.id)
            return value if isinstance(value, str) else None
        return None

    def _tracked(self, node: ast.expr, tracked: dict[str, Tracked]) -> Tracked | None:
        if isinstance(node, ast.Name):
            return tracked.get(node.id)
        if isinstance(node, ast.Tuple):
            parts = tuple(self._tracked(e, tracked) for e in node.elts)
            return parts if any(p is not None for p in parts) else None
        return None

    @staticmethod
    def _key(node: ast.expr, consts: dict[str, str]) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name) and node.id in consts:
            return consts[node.id]
        raise Unfollowable(f"line {node.lineno}: a key that is not a string: {ast.unparse(node)}")


def _string_defaults(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, str]:
    positional = fn.args.posonlyargs + fn.args.args
    pairs = list(zip(positional[len(positional) - len(fn.args.defaults) :], fn.args.defaults))
    pairs += [(a, d) for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is not None]
    return {
        a.arg: d.value for a, d in pairs if isinstance(d, ast.Constant) and isinstance(d.value, str)
    }
