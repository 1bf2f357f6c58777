"""Who a request is for and how urgent it is: its tenant and priority class.

With ``tenants.api_keys`` configured a key is required (``Authorization: Bearer <key>``;
none or unknown: 401) and names the tenant and the highest class its requests may take;
without keys the tenant is the ``X-KVFabric-Tenant`` header (``default`` without one): a
gateway on a trusted network. Either way ``X-KVFabric-Priority: interactive|batch`` asks
for a class, capped at the key's (a batch key cannot jump the queue by saying interactive).
Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from kvfabric.gateway.config import ApiKeyConfig
from kvfabric.sched.model import Priority

TENANT_HEADER = "x-kvfabric-tenant"
PRIORITY_HEADER = "x-kvfabric-priority"
DEFAULT_TENANT = "default"
MAX_TENANT_CHARS = 128


class Unauthorized(Exception):
    """No key, or a key the gateway does not know."""


class BadHeader(ValueError):
    """A tenant or priority header that is not one."""


@dataclass(frozen=True)
class Caller:
    tenant: str
    priority: Priority


def identify(headers: Mapping[str, str], api_keys: Mapping[str, ApiKeyConfig]) -> Caller:
    asked = headers.get(PRIORITY_HEADER)
    try:
        wanted = Priority(asked.strip().lower()) if asked else None
    except ValueError:
        choices = [p.value for p in Priority]
        raise BadHeader(f"{PRIORITY_HEADER} must be one of {choices}") from None
    if api_keys:
        key = _bearer(headers.get("authorization", ""))
        found = next(
            (cfg for k, cfg in api_keys.items() if hmac.compare_digest(k.encode(), key.encode())),
            None,
        )
        if found is None:
            raise Unauthorized("an API key is required (Authorization: Bearer <key>)")
        ceiling = Priority(found.priority)
        if wanted is None or (ceiling is Priority.BATCH and wanted is Priority.INTERACTIVE):
            wanted = ceiling
        return Caller(found.tenant, wanted)
    tenant = headers.get(TENANT_HEADER, DEFAULT_TENANT).strip() or DEFAULT_TENANT
    if len(tenant) > MAX_TENANT_CHARS or not tenant.isprintable():
        raise BadHeader(f"{TENANT_HEADER} must be printable, at most {MAX_TENANT_CHARS} chars")
    return Caller(tenant, wanted or Priority.INTERACTIVE)


def _bearer(value: str) -> str:
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""
