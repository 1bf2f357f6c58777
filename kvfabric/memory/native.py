"""The compiled copy routines of ``_strided.c``, or None where the install did not build them.

``pip install`` compiles the extension (setup.py) when a C compiler is there; without one the
install still succeeds and every caller takes its pure-Python/torch path. Callers read
:data:`kernel` at call time, so tests can set it to None to run those paths.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def _load() -> ModuleType | None:
    try:
        return importlib.import_module("kvfabric.memory._strided")  # optional C extension
    except ImportError:
        return None


kernel: ModuleType | None = _load()
