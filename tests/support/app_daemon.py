"""What the HTTP app reads of a daemon, in process: a real TieredStore (one small DRAM
tier), its instrumentation and metrics, and the daemon's plain attributes, for tests that
drive ``create_app`` through FastAPI's TestClient without starting a daemon process."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

from kvfabric.api.metrics import Metrics
from kvfabric.config import AuthConfig, DaemonConfig
from kvfabric.server.instrumented import InstrumentedStore
from kvfabric.store import StoreConfig, TierConfig, TieredStore
from kvfabric.tiers.base import TierKind


@contextmanager
def app_daemon(
    data_dir: Path, auth: AuthConfig, dram_bytes: int, **extra: object
) -> Iterator[SimpleNamespace]:
    """A single-node daemon stand-in (no global index); ``extra`` adds or replaces
    attributes (e.g. ``transfers``). The store is closed on exit."""
    tiers = (TierConfig(TierKind.DRAM, dram_bytes, page_size=4096),)
    store = TieredStore(StoreConfig(data_dir=str(data_dir), tiers=tiers), maintenance=False)
    metrics = Metrics(store)
    try:
        yield SimpleNamespace(
            config=DaemonConfig(auth=auth),
            store=InstrumentedStore(store, metrics),
            metrics=metrics,
            node_id="node-a",
            ready=True,
            started_at=0.0,
            session_count=0,
            cluster=None,
            **extra,
        )
    finally:
        store.close()
