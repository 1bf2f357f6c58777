"""Who a presented token belongs to: one answer for the control socket and the HTTP API.

The tokens are ``config.auth``'s: the admin token (``auth.token``, or ``auth.token_file``
re-read on every call so it can be rotated) and tenant tokens (``auth.tenants``: token ->
the one tenant it may touch). No token configured: authentication is off and every caller
is the admin.

:func:`resolve` compares the presented token with every configured token, each in
constant time on SHA-256 digests (equal lengths: the time does not tell a token's length
either), and never stops at a match, so how long it takes does not tell which token
matched, or whether it was the admin's. Callers pass the bytes as they arrived: the control
socket's hello ``token`` string encoded as UTF-8, the HTTP ``Authorization: Bearer``
credentials as the header's bytes. ``None`` or an empty token is refused. What a refused
caller is told (an ``AuthError`` on the socket, a 401 on HTTP) is the plane's business.
Errors: :class:`~kvfabric.errors.ConfigError` when the token file cannot be read.

Used by :mod:`kvfabric.server.handlers` (hello) and :mod:`kvfabric.api.app` (every
request); it imports neither.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from kvfabric.config import AuthConfig
from kvfabric.errors import ForbiddenError
from kvfabric.spec import Namespace

Role = Literal["admin", "tenant"]


@dataclass(frozen=True)
class Principal:
    """The caller: the admin (``tenant`` None; everyone when auth is off) or one tenant."""

    tenant: str | None = None

    @property
    def role(self) -> Role:
        return "admin" if self.tenant is None else "tenant"

    @property
    def is_admin(self) -> bool:
        return self.tenant is None

    def check_namespace(self, ns: Namespace) -> None:
        if self.tenant is not None and ns.tenant_salt != self.tenant:
            raise ForbiddenError(f"this token may only look up tenant {self.tenant!r}")


ADMIN = Principal()


def resolve(auth: AuthConfig, presented: bytes | None) -> Principal | None:
    """The principal ``presented`` belongs to (:data:`ADMIN` when auth is off); None when
    it is missing, empty or nobody's. The admin's token wins over a tenant's equal one."""
    admin = auth.admin_token
    if admin is None and not auth.tenants:
        return ADMIN
    if not presented:
        return None
    candidates = [(admin, ADMIN)] if admin is not None else []
    candidates += [(token, Principal(tenant)) for token, tenant in auth.tenants.items()]
    digest = hashlib.sha256(presented).digest()
    found = None
    for token, principal in candidates:  # no early exit: timing does not tell which matched
        if hmac.compare_digest(digest, _configured_digest(token)) and found is None:
            found = principal
    return found


@lru_cache(maxsize=4096)
def _configured_digest(token: str) -> bytes:
    """A configured token's digest, computed once (HTTP checks every request against every
    token); only configured tokens are cached, never a presented one."""
    return hashlib.sha256(token.encode()).digest()
