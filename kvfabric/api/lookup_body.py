"""Parsing a ``/v1/lookup`` body off the event loop, bounded before the expensive part.

Contract: :func:`parse_lookup` runs on a worker thread (never the HTTP or control loop) and
turns raw body bytes (already capped by :class:`~kvfabric.api.body_limit.BodyLimit`) into a
validated request model:

1. the JSON is parsed in pieces, giving the GIL back between them, so no single call holds
   it for long (one ``json.loads`` of a 15 MB body held it for 0.3 s, stalling the control
   plane's loop that long): the top-level object is walked key by key; the two lists that may
   be long (``token_ids``, ``chunk_hashes``) are parsed :data:`PIECE_CHARS` characters at a
   time, cut at commas (their valid items never contain one, so a cut inside an item only
   turns an invalid body into a 422); any other value must fit in :data:`VALUE_CHARS`.
   Malformed JSON is :class:`BodyInvalid`;
2. the count of ``token_ids`` / ``chunk_hashes`` is checked *before* any item is parsed, by
   counting the list's separators (one C call, instead of a second of parsing for three
   million ids): over ``max_tokens`` token ids is :class:`BodyTooLarge` (413), over
   ``max_hashes`` hashes a 422 with one issue (a malformed list with extra commas may count
   high: it is refused either way);
3. the items are checked in slices of :data:`SLICE` by plain type and range tests (token ids:
   ``int``, not ``bool``, in int32, a slice of plain ints by its min and max; hashes: hex
   strings of the key length), releasing the GIL between slices; a bad item is one issue, at
   most :data:`MAX_ISSUES` reported plus how many more there are, never echoing the input.
   Building one pydantic error per item cost 13 s for a million bad ids;
4. the rest of the body (namespace, scope, exactly one of the lists) is validated by the
   model, with the long lists swapped out for empty ones, then swapped back in.

Steps 1-3 are :func:`parse_body` (plain data in, plain data out: what a worker process runs,
:mod:`kvfabric.api.lookup_workers`), step 4 is :func:`build`; :func:`parse_lookup` is both.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from json.decoder import scanstring  # type: ignore[attr-defined]  # public, untyped
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # pydantic is imported where a model is built: parser processes skip it
    from pydantic import BaseModel

SLICE = 1 << 15
PIECE_CHARS = 1 << 17  # ~2 ms of json.loads per piece
VALUE_CHARS = 1 << 16  # the namespace, scope: small
LONG_LISTS = ("token_ids", "chunk_hashes")
_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
MAX_ISSUES = 10
INT32 = (-(1 << 31), (1 << 31) - 1)

Model = TypeVar("Model", bound="BaseModel")


class BodyTooLarge(Exception):
    """A count over its configured limit (answered 413, kind ``too_large``)."""


class BodyInvalid(Exception):
    """``issues``: at most :data:`MAX_ISSUES` ``{loc, msg, type}``; ``total``: how many."""

    def __init__(self, issues: list[dict[str, Any]], total: int) -> None:
        super().__init__(f"{total} invalid item(s)")
        self.issues, self.total = issues, total


def parse_lookup(
    raw: bytes, model: type[Model], *, max_tokens: int, max_hashes: int, hash_chars: int
) -> Model:
    data, lists = parse_body(
        raw, max_tokens=max_tokens, max_hashes=max_hashes, hash_chars=hash_chars
    )
    return build(model, data, lists)


def parse_body(
    raw: bytes | bytearray, *, max_tokens: int, max_hashes: int, hash_chars: int
) -> tuple[Any, dict[str, list[Any]]]:
    """Steps 1-3: the body without its checked long lists (each replaced by ``[]``), and
    those lists by name. Raises BodyInvalid / BodyTooLarge."""
    try:
        data = _loads(raw.decode("utf-8"), {"token_ids": max_tokens, "chunk_hashes": max_hashes})
    except _TooMany as many:
        if many.name == "token_ids":
            raise BodyTooLarge(
                f"{many.count} token ids in one lookup; at most {max_tokens} "
                "(limits.lookup_max_tokens)"
            ) from None
        raise BodyInvalid(
            [_issue([many.name], f"List should have at most {max_hashes} items", "too_long")], 1
        ) from None
    except (ValueError, UnicodeDecodeError, IndexError, RecursionError) as exc:
        raise BodyInvalid([_issue([], f"JSON decode error: {exc}", "json_invalid")], 1) from None
    lists: dict[str, list[Any]] = {}
    if not isinstance(data, dict):
        return data, lists  # the model reports the wrong shape
    tokens, hashes = data.get("token_ids"), data.get("chunk_hashes")
    if isinstance(tokens, list):
        _check_items("token_ids", tokens, _bad_tokens, "an integer in int32")
        lists["token_ids"] = tokens
    if isinstance(hashes, list):
        _check_items(
            "chunk_hashes",
            hashes,
            _bad_hashes(hash_chars),
            f"a hex string of {hash_chars} characters",
        )
        lists["chunk_hashes"] = hashes
    return {**data, **{name: [] for name in lists}}, lists


def build(model: type[Model], data: Any, lists: dict[str, Any]) -> Model:
    """Step 4: ``data`` (the body less its long lists) validated by ``model``, then the lists
    (already checked) put back as given."""
    parsed = _validate(model, data)
    for name, items in lists.items():
        setattr(parsed, name, items)  # checked above; the model holds them as given
    return parsed


class _TooMany(Exception):
    def __init__(self, name: str, count: int) -> None:
        super().__init__(f"{count} items in {name}")
        self.name, self.count = name, count


def _loads(text: str, max_items: dict[str, int] | None = None) -> Any:
    """``json.loads(text)``, in pieces (see the module docstring); ValueError if malformed,
    _TooMany when a long list has more items than ``max_items`` allows it."""
    i = _WS.match(text, 0).end()  # type: ignore[union-attr]
    if not text.startswith("{", i):
        return _small_value(text, i, "body", whole=True)[0]
    out: dict[str, Any] = {}
    i = _skip(text, i + 1)
    if text.startswith("}", i):
        return _end(text, i + 1, out)
    while True:
        if not text.startswith('"', i):
            raise ValueError(f"expected a key at {i}")
        key, i = scanstring(text, i + 1)
        i = _skip(text, i)
        if not text.startswith(":", i):
            raise ValueError(f"expected ':' at {i}")
        i = _skip(text, i + 1)
        if key in LONG_LISTS and text.startswith("[", i):
            out[key], i = _long_list(text, i, key, (max_items or {}).get(key))
        else:
            out[key], i = _small_value(text, i, key)
        i = _skip(text, i)
        if text.startswith(",", i):
            i = _skip(text, i + 1)
        elif text.startswith("}", i):
            return _end(text, i + 1, out)
        else:
            raise ValueError(f"expected ',' or '}}' at {i}")


def _skip(text: str, i: int) -> int:
    return _WS.match(text, i).end()  # type: ignore[union-attr]


def _end(text: str, i: int, value: Any) -> Any:
    if _skip(text, i) != len(text):
        raise ValueError(f"extra data at {i}")
    return value


def _small_value(text: str, i: int, key: str, *, whole: bool = False) -> tuple[Any, int]:
    window = text[i : i + VALUE_CHARS] if not whole else text[i:]
    truncated = len(window) < len(text) - i
    value, end = _DECODER.raw_decode(window)
    if truncated and end >= len(window) - 1:  # it may go on past the window
        raise ValueError(f"the value of {key!r} is over {VALUE_CHARS} characters")
    return value, i + end


def _long_list(text: str, i: int, key: str, max_items: int | None) -> tuple[list[Any], int]:
    """The array at ``text[i] == '['``, parsed PIECE_CHARS at a time once its separators say
    it is not over ``max_items``."""
    end = text.find("]", i)
    if end < 0:
        raise ValueError(f"unterminated array at {i}")
    items: list[Any] = []
    pos = i + 1
    if not text[pos:end].strip(" \t\n\r"):
        return items, end + 1
    if max_items is not None:
        count = text.count(",", pos, end) + 1
        if count > max_items:
            raise _TooMany(key, count)
    while pos <= end:
        cut = text.rfind(",", pos, pos + PIECE_CHARS) if end - pos > PIECE_CHARS else -1
        if cut < 0:
            cut = end  # the rest fits (or one item is longer than a piece)
        piece = text[pos:cut]
        if not piece.strip(" \t\n\r"):
            raise ValueError(f"empty item at {pos}")
        items.extend(json.loads("[" + piece + "]"))
        pos = cut + 1
        time.sleep(0)  # give the GIL to other threads between pieces
    return items, end + 1


def _validate(model: type[Model], data: Any) -> Model:
    from pydantic import ValidationError

    try:
        return model.model_validate(data)
    except ValidationError as exc:  # few: the long lists are not in it
        errors = exc.errors(include_url=False, include_input=False, include_context=False)
        raise BodyInvalid(
            [_issue(list(e["loc"]), e["msg"], e["type"]) for e in errors[:MAX_ISSUES]], len(errors)
        ) from None


def _check_items(
    name: str, items: list[Any], find_bad: Callable[[list[Any], int], list[int]], want: str
) -> None:
    """``find_bad(part, start)``: the positions of the bad items of ``part`` (which starts at
    ``start``)."""
    issues: list[dict[str, Any]] = []
    total = 0
    for start in range(0, len(items), SLICE):
        found = find_bad(items[start : start + SLICE], start)
        total += len(found)
        issues.extend(
            _issue([name, i], f"must be {want}", "invalid_item")
            for i in found[: MAX_ISSUES - len(issues)]
        )
        time.sleep(0)  # let other threads have the GIL between slices
    if total:
        raise BodyInvalid(issues, total)


def _bad_tokens(part: list[Any], start: int) -> list[int]:
    """Token ids: an int (not a bool) in int32 each. A slice of plain ints is checked by C
    calls (its set of types, min and max); only a slice that fails is walked item by item."""
    lo, hi = INT32
    if set(map(type, part)) <= {int}:
        if not part or (lo <= min(part) and max(part) <= hi):
            return []
        return [i for i, item in enumerate(part, start) if not lo <= item <= hi]
    return [i for i, item in enumerate(part, start) if _bad_token(item)]


def _bad_token(item: Any) -> bool:
    return type(item) is not int or not INT32[0] <= item <= INT32[1]


def _bad_hashes(chars: int) -> Callable[[list[Any], int], list[int]]:
    bad = _bad_hash(chars)
    return lambda part, start: [i for i, item in enumerate(part, start) if bad(item)]


def _bad_hash(chars: int) -> Callable[[Any], bool]:
    def bad(item: Any) -> bool:
        if type(item) is not str or len(item) != chars:
            return True
        try:
            return 2 * len(bytes.fromhex(item)) != chars  # fromhex skips spaces: count
        except ValueError:
            return True

    return bad


def _issue(loc: list[str | int], msg: str, kind: str) -> dict[str, Any]:
    return {"loc": ["body", *loc], "msg": msg, "type": kind}
