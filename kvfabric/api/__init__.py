"""The daemon's HTTP plane: the FastAPI app (:mod:`kvfabric.api.app`) and the Prometheus
metrics every plane records into (:mod:`kvfabric.api.metrics`).

``Metrics`` loads on first use (PEP 562): the control server and the instrumented store need
it without pulling in FastAPI, and a lookup parser process
(:mod:`kvfabric.api.lookup_workers`) needs neither it nor prometheus_client.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing

if TYPE_CHECKING:
    from typing import Any

    from kvfabric.api.metrics import Metrics

__all__ = ["Metrics"]


def __getattr__(name: str) -> Any:
    if name != "Metrics":
        raise AttributeError(f"module 'kvfabric.api' has no attribute {name!r}")
    value = importlib.import_module("kvfabric.api.metrics").Metrics
    globals()[name] = value  # later lookups skip this function
    return value
