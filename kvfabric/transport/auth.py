"""HMAC helpers for the peer handshake and for signed descriptors.

Contract: a cluster secret is optional. Without one, :func:`sign` returns ``b""`` and
:func:`verify` accepts anything, so clusters that do not configure a secret still talk. With
one, every MAC is HMAC-SHA256 over a *purpose* label plus length-prefixed parts, so a MAC made
for one purpose (say, the client's proof) can never be replayed as another (the server's), and
parts cannot be re-split (``"ab" + "c"`` vs ``"a" + "bc"``). Comparison is constant-time.
A side with a secret refuses a peer without one: :class:`~kvfabric.errors.AuthError`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

from kvfabric.errors import AuthError

NONCE_BYTES = 16
_PART_LEN = struct.Struct("<I")


def new_nonce() -> bytes:
    """A fresh random challenge; one per connection and side."""
    return os.urandom(NONCE_BYTES)


def sign(secret: bytes | None, purpose: str, *parts: bytes) -> bytes:
    """The MAC of ``parts`` for ``purpose`` (``b""`` when no secret is configured)."""
    if not secret:
        return b""
    mac = hmac.new(secret, purpose.encode(), hashlib.sha256)
    for part in parts:
        mac.update(_PART_LEN.pack(len(part)))
        mac.update(part)
    return mac.digest()


def verify(secret: bytes | None, mac: object, purpose: str, *parts: bytes) -> None:
    """Raise :class:`AuthError` unless ``mac`` is the MAC of ``parts`` under ``secret``."""
    if not secret:
        return
    if not isinstance(mac, bytes) or not mac:
        raise AuthError(f"peer sent no credentials for {purpose} (a cluster secret is set)")
    if not hmac.compare_digest(mac, sign(secret, purpose, *parts)):
        raise AuthError(f"bad credentials for {purpose}: the peer has a different cluster secret")
