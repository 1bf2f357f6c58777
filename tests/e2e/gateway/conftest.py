"""The gateway's end-to-end tests are bounded by deadlines derived from the measured engine
start, not by pytest-timeout's fixed 300 s (a module fixture starting engines counts against
its first test), as tests/e2e/vllm/'s are. `tiny_model` comes from tests/e2e/conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.timeout(0))
