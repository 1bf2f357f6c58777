"""Peer transports (see :mod:`kvfabric.transport.base` for the contract).

:func:`select_backend` maps a config value to a transport class: ``"auto"`` picks NIXL when
it imports (``nixl``, else ``nixl_cu12``: :mod:`kvfabric.transport.nixl_module`) and can
create a UCX agent here, else the socket backend; ``"nixl"`` and ``"socket"`` force one. The
NIXL probe runs once per process.
"""

from __future__ import annotations

import functools
import logging

from kvfabric.errors import ConfigError, UnavailableError
from kvfabric.transport.base import (
    Peer,
    PeerDescriptor,
    ReadPiece,
    RegionInfo,
    Transport,
    WritePiece,
)
from kvfabric.transport.socket_backend import SocketTransport

log = logging.getLogger(__name__)

BACKENDS = ("auto", "nixl", "socket")

__all__ = [
    "BACKENDS",
    "Peer",
    "PeerDescriptor",
    "ReadPiece",
    "RegionInfo",
    "SocketTransport",
    "Transport",
    "WritePiece",
    "nixl_unavailable_reason",
    "select_backend",
]


@functools.cache
def nixl_unavailable_reason() -> str | None:
    """``None`` when NIXL works here, else why not (import failure, no UCX backend, ...)."""
    try:
        from kvfabric.transport.nixl_module import nixl_api

        api = nixl_api()
        api.nixl_agent("kvfabric-probe", api.nixl_agent_config(backends=["UCX"]))
    except Exception as exc:  # ImportError, missing libs, backend creation failures
        return f"{type(exc).__name__}: {exc}"
    return None


def select_backend(preferred: str = "auto") -> type[Transport]:
    """The transport class for ``preferred`` (``ConfigError`` unknown, ``UnavailableError``)."""
    if preferred not in BACKENDS:
        raise ConfigError(f"unknown transport {preferred!r}; choose one of {BACKENDS}")
    if preferred == "socket":
        return SocketTransport
    reason = nixl_unavailable_reason()
    if reason is None:
        from kvfabric.transport.nixl_backend import NixlTransport

        return NixlTransport
    if preferred == "nixl":
        raise UnavailableError(
            f"transport 'nixl' is not available here: {reason} "
            "(install the kvfabric[nixl] extra: nixl-cu12 --no-deps)"
        )
    log.info("NIXL unavailable (%s); using the socket transport", reason)
    return SocketTransport
