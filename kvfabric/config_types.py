"""The value types every configuration model is built from, each with one message style.

Each type is an ``Annotated`` base type with a pydantic *plain* validator: the validator
alone decides what is accepted (no lax coercion behind its back: ``true`` is not the
integer 1, ``"8080"`` from a YAML file is not a port), and says what is wrong as
``must be ..., got <value>``. :mod:`kvfabric.config_model` puts the dotted key in front, so
a failure reads ``limits.max_sessions: must be a positive integer, got 0``. Strings are
never echoed back (a token or a Redis URL may be a secret): their messages name the type.

Sizes (:data:`ByteSize`) take an int or a string with a decimal or binary unit: ``4096``,
``"4GiB"``, ``"512 MiB"``, ``"1.5g"``, ``"10kb"``; see :func:`parse_size`.

Validators raise :class:`~kvfabric.errors.ConfigError` (a ``ValueError``), which pydantic
collects with the key it was raised under.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Annotated, Any, TypeVar

from pydantic import PlainValidator

from kvfabric.errors import ConfigError

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
_UNITS = {
    "": 1,
    "b": 1,
    "k": KiB,
    "kb": 1000,
    "kib": KiB,
    "m": MiB,
    "mb": 1000**2,
    "mib": MiB,
    "g": GiB,
    "gb": 1000**3,
    "gib": GiB,
    "t": TiB,
    "tb": 1000**4,
    "tib": TiB,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")

T = TypeVar("T")


def size_bytes(value: object, *, zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"expected a size, got {value!r}")
    if isinstance(value, (int, float)):
        size = int(value)  # a YAML float is a number of bytes (truncated), as it always was
    else:
        match = _SIZE.fullmatch(value)
        if not match or match.group(2).lower() not in _UNITS:
            raise ConfigError(f"cannot parse size {value!r} (e.g. 4GiB, 512MiB)")
        size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size < 0 or (size == 0 and not zero):
        raise ConfigError(f"must be {'non-negative' if zero else 'positive'}, got {value!r}")
    return size


def parse_size(value: int | str, what: str = "size") -> int:
    """``"4GiB"``, ``"512 MiB"``, ``"1.5g"`` or an int -> bytes; ConfigError naming ``what``."""
    try:
        return size_bytes(value)
    except ConfigError as exc:
        raise ConfigError(f"{what}: {exc}") from None


def format_size(n: float) -> str:
    """Bytes for people: ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def int_in(low: int, high: int | None = None, *, why: str = "") -> Callable[..., int]:
    """A validator of ints in ``[low, high]`` (``high`` None: no upper bound); ``why`` says
    where a bound comes from."""
    if high is not None:
        rule = f"must be an integer in [{low}, {high}]"
    elif low in (0, 1):
        rule = f"must be a {'positive' if low else 'non-negative'} integer"
    else:
        rule = f"must be an integer of at least {low}"
    if why:
        rule += f" ({why})"

    def check(value: object) -> int:
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            and low <= value
            and (high is None or value <= high)
        ):
            return value
        raise ConfigError(f"{rule}, got {value!r}")

    return check


_EXPONENT = re.compile(r"[+-]?\d+(\.\d*)?[eE][+-]?\d+")


def _number(value: object, rule: str = "must be a number") -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    # YAML 1.1 (PyYAML) reads ``1e9`` and ``1.25e9`` as strings: it wants ``1.25e+9``
    if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
        return float(value)
    raise ConfigError(f"{rule}, got {value!r}")


def _seconds(value: object, *, zero: bool) -> float:
    rule = f"must be a {'non-negative' if zero else 'positive'} number of seconds"
    number = _number(value, rule)
    if number < 0 or (number == 0 and not zero):
        raise ConfigError(f"{rule}, got {value!r}")
    return number


def _share(value: object) -> float:
    share = _number(value, "must be a share in [0, 1]")
    if not 0 <= share <= 1:
        raise ConfigError(f"must be a share in [0, 1], got {value!r}")
    return share


def _flag(value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"must be true or false, got {value!r}")
    return value


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"must be a string, got {type(value).__name__}")
    return value


def _path(value: object) -> str:
    if not isinstance(value, str) or not value or "\x00" in value:
        raise ConfigError("must be a path string (not empty, no NUL byte)")
    return value


def one_of(*choices: str) -> Callable[..., str]:
    """A validator of strings among ``choices``."""

    def check(value: object) -> str:
        if isinstance(value, str) and value in choices:
            return value
        raise ConfigError(f"must be one of {list(choices)}, got {value!r}")

    return check


def optional(check: Callable[[Any], T]) -> Callable[[Any], T | None]:
    """``check``, with None (YAML ``null``) accepted as "not set"."""

    def maybe(value: object) -> T | None:
        return None if value is None else check(value)

    return maybe


ByteSize = Annotated[int, PlainValidator(size_bytes)]
ByteSizeOrZero = Annotated[int, PlainValidator(partial(size_bytes, zero=True))]
PositiveInt = Annotated[int, PlainValidator(int_in(1))]
NonNegativeInt = Annotated[int, PlainValidator(int_in(0))]
Seconds = Annotated[float, PlainValidator(partial(_seconds, zero=False))]
SecondsOrZero = Annotated[float, PlainValidator(partial(_seconds, zero=True))]
Share = Annotated[float, PlainValidator(_share)]
Number = Annotated[float, PlainValidator(_number)]
Flag = Annotated[bool, PlainValidator(_flag)]
OptionalFlag = Annotated[bool | None, PlainValidator(optional(_flag))]
Text = Annotated[str, PlainValidator(_text)]
OptionalText = Annotated[str | None, PlainValidator(optional(_text))]
PathText = Annotated[str, PlainValidator(_path)]
OptionalPath = Annotated[str | None, PlainValidator(optional(_path))]
