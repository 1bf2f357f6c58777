"""Where NIXL's Python API comes from: the one place kvfabric imports NIXL.

``nixl`` is NIXL's own package name: on a GPU node ``pip install nixl[cu12]`` (or ``cu13``)
installs the meta package, which finds its CUDA variant and serves it as ``nixl._api``. Where
only ``nixl-cu12`` is installed (``--no-deps``, as on CPU machines: the meta package's
dependencies pull a CUDA torch) the same API is ``nixl_cu12._api``.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

CANDIDATES = ("nixl._api", "nixl_cu12._api")


def nixl_api() -> ModuleType:
    """NIXL's ``_api`` module (``nixl_agent``, ``nixl_agent_config``); ``ImportError`` naming
    every candidate when none imports."""
    failures: list[str] = []
    for name in CANDIDATES:
        try:
            api = importlib.import_module(name)
        except ImportError as exc:  # the meta package raises ImportError without a variant
            failures.append(f"{name}: {exc}")
            continue
        _adopt_logging()
        return api
    raise ImportError(f"NIXL is not installed ({'; '.join(failures)})")


def _adopt_logging() -> None:
    """NIXL's log lines go through the process's logging (level, text or JSON lines:
    kvfabric.logfmt) instead of the handler of its own that prints them to stdout."""
    logger = logging.getLogger("nixl")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.propagate = True
