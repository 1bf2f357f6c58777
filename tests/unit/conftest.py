"""Fixtures shared by unit tests of more than one package."""

from __future__ import annotations

import pytest

from kvfabric.memory import native


@pytest.fixture(params=["kernel", "fallback"])
def copy_routine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test once with the compiled copy kernel and once with its Python fallback."""
    assert native.kernel is not None  # the install builds it: both paths really run
    if request.param == "fallback":
        monkeypatch.setattr(native, "kernel", None)
    return request.param
