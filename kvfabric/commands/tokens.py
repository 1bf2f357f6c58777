"""Prompt token ids from the command line: a JSON list, a ``.npy`` array or plain text."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from kvfabric.errors import SpecError
from kvfabric.hashing import as_token_array


def read_tokens_file(path: Path) -> np.ndarray:
    """``.npy`` (a 1-D integer array), else text as accepted by :func:`parse_tokens`."""
    try:
        if path.suffix.lower() == ".npy":
            return as_token_array(np.load(path, allow_pickle=False))
        return parse_tokens(path.read_text())
    except (OSError, ValueError) as exc:  # SpecError is a ValueError
        raise SpecError(f"tokens file {str(path)!r}: {exc}") from None


def parse_tokens(text: str) -> np.ndarray:
    """A JSON list of ints (``[1, 2, 3]``), or ints separated by whitespace and/or commas."""
    text = text.strip()
    if text.startswith("["):
        values = json.loads(text)
        if not isinstance(values, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in values
        ):
            raise SpecError("a JSON tokens list must hold integers only")
        return as_token_array(values)
    words = [w for w in re.split(r"[\s,]+", text) if w]
    bad = next((w for w in words if not re.fullmatch(r"[+-]?\d+", w)), None)
    if bad is not None:
        raise SpecError(f"not a token id: {bad[:32]!r}")
    return as_token_array([int(w) for w in words])
