"""NIXL comes from ``nixl`` (NIXL's own package) and else from ``nixl_cu12`` (installed alone
with --no-deps); with neither, one ImportError names both."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from kvfabric.transport.nixl_module import nixl_api


def fake_api(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.nixl_agent = lambda *a, **k: name  # type: ignore[attr-defined]
    return module


@pytest.fixture
def neither(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    # None in sys.modules: `import x` raises ImportError, whatever is installed
    for name in ("nixl", "nixl._api", "nixl_cu12", "nixl_cu12._api"):
        monkeypatch.setitem(sys.modules, name, None)
    return monkeypatch


def test_nixl_first(neither: pytest.MonkeyPatch) -> None:
    neither.setitem(sys.modules, "nixl._api", fake_api("nixl._api"))
    neither.setitem(sys.modules, "nixl_cu12._api", fake_api("nixl_cu12._api"))
    assert nixl_api().__name__ == "nixl._api"


def test_nixl_cu12_when_nixl_is_missing(neither: pytest.MonkeyPatch) -> None:
    neither.setitem(sys.modules, "nixl_cu12._api", fake_api("nixl_cu12._api"))
    assert nixl_api().nixl_agent() == "nixl_cu12._api"


def test_neither_names_both(neither: pytest.MonkeyPatch) -> None:
    with pytest.raises(ImportError, match=r"nixl\._api: .*; nixl_cu12\._api: "):
        nixl_api()


def test_nixl_logs_through_the_process_logging(neither: pytest.MonkeyPatch) -> None:
    """NIXL's own stdout handler would put text lines among the daemon's JSON ones."""
    neither.setitem(sys.modules, "nixl_cu12._api", fake_api("nixl_cu12._api"))
    logger = logging.getLogger("nixl")
    neither.setattr(logger, "handlers", [logging.StreamHandler(sys.stdout)])
    neither.setattr(logger, "propagate", False)
    nixl_api()
    assert logger.handlers == [] and logger.propagate
