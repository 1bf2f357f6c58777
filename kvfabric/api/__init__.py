"""The daemon's HTTP plane: the FastAPI app (:mod:`kvfabric.api.app`) and the Prometheus
metrics every plane records into (:mod:`kvfabric.api.metrics`).

Only :mod:`kvfabric.api.metrics` is imported here: the control server and the instrumented
store need it without pulling in FastAPI.
"""

from kvfabric.api.metrics import Metrics

__all__ = ["Metrics"]
