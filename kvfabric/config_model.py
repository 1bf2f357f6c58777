"""Configuration models: frozen pydantic dataclasses, one error type, one message style.

Every configuration value of kvfabric (the daemon's sections, the store and its tiers, each
engine plugin's settings) is a class decorated with :func:`config_value`: a frozen pydantic
dataclass with ``extra="forbid"``. It is still a dataclass (positional construction,
``dataclasses.replace``, ``asdict`` and ``fields`` work as before) and it validates however it
is built: constructed directly, through :func:`parse_config` from a plain mapping (parsed YAML,
an engine's extra-config dict), or nested inside another model.

Errors. Whatever is wrong, the caller gets one :class:`~kvfabric.errors.ConfigError` (never
pydantic's ``ValidationError``) whose message is ``<dotted.key>: <what is wrong>`` per
problem, problems joined by ``"; "``: ``store.tiers[1].capacity: cannot parse size 'lots'
(e.g. 4GiB, 512MiB)``, ``http.bogus: unknown key (allowed: host, port)``. Tuple and list
entries are ``[i]``; a problem of a whole model (two fields that contradict each other) is
reported under the model's own key. Validators inside a model raise ConfigError for the
value they check, or :class:`KeyProblems` for problems of keys below it (the key joins the
path).

Unknown keys. A model lists the keys it takes (its fields; a class may narrow them per input
with a ``config_keys(data)`` classmethod, as a tier does per kind); any other key is refused
by name, with the allowed ones.

Renamed keys. :func:`apply_renames` moves a value from an old dotted key to its new one,
warning (``DeprecationWarning`` and the ``kvfabric.config`` log) that the old name will go:
a user's file keeps working for a release while it says what to change. Setting both names is
an error (which one meant it?).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar, cast, dataclass_transform

import yaml
from pydantic import ConfigDict, ValidationError, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass
from pydantic_core import ArgsKwargs, ErrorDetails

from kvfabric.errors import ConfigError

log = logging.getLogger("kvfabric.config")

T = TypeVar("T")

# pydantic's error types, in the words of our messages
_MESSAGES = {
    "missing": "required",
    "missing_argument": "required",
    "unexpected_keyword_argument": "unknown key",
    "extra_forbidden": "unknown key",
    "dataclass_type": "must be a mapping",
    "dataclass_args_type": "must be a mapping",
    "dict_type": "must be a mapping",
    "mapping_type": "must be a mapping",
    "list_type": "must be a list",
    "tuple_type": "must be a list",
}


class KeyProblems(ValueError):
    """Raised by a model's validator: problems of keys below the value it checks, as
    ``(key, message)`` pairs (``key`` dotted, relative to the value)."""

    def __init__(self, problems: Iterable[tuple[str, str]]) -> None:
        self.problems = tuple(problems)
        super().__init__("; ".join(f"{key}: {message}" for key, message in self.problems))


def key_path(parts: Iterable[str | int]) -> str:
    """``("store", "tiers", 1, "capacity")`` -> ``store.tiers[1].capacity``."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part:
            out += f".{part}" if out else str(part)
    return out


def _join(where: str, key: str) -> str:
    if not where:
        return key
    return f"{where}{key}" if key.startswith("[") else f"{where}.{key}" if key else where


def _problems(error: ErrorDetails, where: str, fields: list[str]) -> list[tuple[str, str]]:
    loc = list(error["loc"])
    if loc and isinstance(loc[0], int) and loc[0] < len(fields):
        loc[0] = fields[loc[0]]  # a positional argument of a constructor: its field's name
    path = _join(where, key_path(loc))
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, KeyProblems):
        return [(_join(path, key), message) for key, message in cause.problems]
    if isinstance(cause, Exception):
        return [(path, str(cause))]
    return [(path, _MESSAGES.get(error["type"], error["msg"]))]


def config_error(
    exc: ValidationError, where: str = "", fields: list[str] | None = None
) -> ConfigError:
    """The ConfigError saying what ``exc`` found, keys prefixed with ``where``; ``fields``:
    the constructor's field names, when ``exc`` comes from positional arguments."""
    problems: list[tuple[str, str]] = []
    for error in exc.errors(include_url=False):
        problems += _problems(error, where, fields or [])
    return ConfigError(
        "; ".join(f"{key}: {message}" if key else message for key, message in problems)
    )


def _refuse_unknown(cls: type, data: Any) -> Any:
    if isinstance(data, ArgsKwargs):
        given: Mapping[str, Any] = data.kwargs or {}
    elif isinstance(data, Mapping):
        given = data
    else:
        return data  # not a mapping: the model's own validation says so
    keys_for: Callable[[Mapping[str, Any]], Collection[str]] | None = getattr(
        cls, "config_keys", None
    )
    allowed = set(keys_for(given) if keys_for else (f.name for f in dataclasses.fields(cls)))
    unknown = sorted(str(key) for key in given if key not in allowed)
    if unknown:
        allowed_text = ", ".join(sorted(allowed))
        raise KeyProblems((key, f"unknown key (allowed: {allowed_text})") for key in unknown)
    return data


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field,))
def config_value(cls: type[T]) -> type[T]:
    """``cls`` as a frozen, validating dataclass that refuses unknown keys (see the module)."""
    # pydantic collects the validators it finds on the class when it builds the model
    refuse_unknown: Any = model_validator(mode="before")(_refuse_unknown)
    cls._refuse_unknown_keys = refuse_unknown  # type: ignore[attr-defined]
    model = pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))(cls)
    validating_init = model.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            validating_init(self, *args, **kwargs)
        except ValidationError as exc:
            fields = [f.name for f in dataclasses.fields(model)]
            raise config_error(exc, fields=fields) from None

    model.__init__ = __init__  # type: ignore[method-assign]
    return cast("type[T]", model)


def parse_config(cls: type[T], data: object, where: str = "") -> T:
    """``data`` (a plain mapping) validated into ``cls``; ConfigError with keys below ``where``."""
    try:
        return cls.__pydantic_validator__.validate_python(data)  # type: ignore[attr-defined,no-any-return]
    except ValidationError as exc:
        raise config_error(exc, where) from None


def read_yaml_mapping(path: str | Path, what: str) -> dict[str, Any]:
    """The YAML file at ``path`` as a mapping (empty: ``{}``); ConfigError naming ``what``
    (e.g. "gateway config") when it cannot be read, is not YAML or is not a mapping."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must be a mapping of keys to values")
    return data


def apply_renames(data: dict[str, Any], renames: Mapping[str, str]) -> dict[str, Any]:
    """``data`` with each old dotted key of ``renames`` moved to its new key (nested mappings
    copied, never changed in place); a DeprecationWarning per old key found."""
    for old, new in renames.items():
        found, value, data = _pop_path(data, old.split("."))
        if not found:
            continue
        message = f"config key {old!r} is deprecated: it is now {new!r}"
        warnings.warn(message, DeprecationWarning, stacklevel=3)
        log.warning("%s", message)
        if _pop_path(data, new.split("."))[0]:
            raise ConfigError(f"{old}: renamed to {new}, which is set too; keep only {new}")
        data = _set_path(data, new.split("."), value)
    return data


def _pop_path(data: dict[str, Any], parts: list[str]) -> tuple[bool, Any, dict[str, Any]]:
    """(found, value, a copy of ``data`` without the key)."""
    head, rest = parts[0], parts[1:]
    if head not in data:
        return False, None, data
    if not rest:
        out = dict(data)
        return True, out.pop(head), out
    child = data[head]
    if not isinstance(child, dict):
        return False, None, data
    found, value, child = _pop_path(child, rest)
    return found, value, {**data, head: child} if found else data


def _set_path(data: dict[str, Any], parts: list[str], value: object) -> dict[str, Any]:
    head, rest = parts[0], parts[1:]
    if not rest:
        return {**data, head: value}
    child = data.get(head)
    if not isinstance(child, dict):
        child = {}
    return {**data, head: _set_path(child, rest, value)}
