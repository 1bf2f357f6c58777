"""What every engine plugin's settings share: unknown keys are an error (a typo must not
fall back to a default silently), the daemon's socket and token default to the node's
environment (``KVFABRIC_SOCKET_PATH``, ``KVFABRIC_TOKEN``), and durations are positive."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from kvfabric.client.client import default_address


def refuse_unknown(
    given: Mapping[str, Any], known: Iterable[str], *, what: str, prefix: str = ""
) -> None:
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(
            f"unknown {what} setting(s) {[prefix + k for k in unknown]}; known: {sorted(known)}"
        )


def with_daemon_defaults(values: dict[str, Any]) -> dict[str, Any]:
    values.setdefault("socket_path", default_address())
    values.setdefault("token", os.environ.get("KVFABRIC_TOKEN"))
    return values


def positive_seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)
