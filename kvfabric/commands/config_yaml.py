"""The effective daemon config as YAML that :func:`kvfabric.config.load_config` reads back.

Tokens are redacted; sizes are written with the largest binary unit that divides them
exactly (``1GiB``), so the output is what an operator would have written.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

import yaml

from kvfabric.config import AuthConfig, DaemonConfig
from kvfabric.store.config import GiB, KiB, MiB, Quota, StoreConfig, TiB, TierConfig

REDACTED = "<redacted>"
_SIZE_KEYS = ("capacity", "page_size", "segment_bytes")
_UNITS = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))


def config_yaml(config: DaemonConfig) -> str:
    return yaml.safe_dump(config_dict(config), sort_keys=False, default_flow_style=False)


def config_dict(config: DaemonConfig) -> dict[str, Any]:
    return {
        "node_id": config.node_id,
        "socket_path": config.socket_path,
        "log_level": config.log_level,
        "log_format": config.log_format,
        "http": asdict(config.http),
        "tcp": asdict(config.tcp),
        "auth": _auth(config.auth),
        "limits": asdict(config.limits),
        "store": _store(config.store),
        "security": asdict(config.security),
    }


def _auth(auth: AuthConfig) -> dict[str, Any]:
    return {
        "token": REDACTED if auth.token else None,
        "token_file": auth.token_file,
        # Keys are tokens: each gets its own placeholder so the tenants stay countable.
        "tenants": {f"{REDACTED}-{i}": tenant for i, tenant in enumerate(auth.tenants.values(), 1)},
    }


def _store(store: StoreConfig) -> dict[str, Any]:
    out = {
        f.name: getattr(store, f.name) for f in fields(store) if f.name not in ("tiers", "quotas")
    }
    out["tiers"] = [_tier(t) for t in store.tiers]
    out["quotas"] = {tenant: _quota(quota) for tenant, quota in store.quotas.items()}
    return out


def _quota(quota: Quota) -> dict[str, Any]:
    out: dict[str, Any] = {
        tier: f"{limit * 100:g}%" if isinstance(limit, float) else _size(limit)
        for tier, limit in quota.tiers.items()
    }
    for key in ("reservations", "namespaces"):
        if getattr(quota, key) is not None:
            out[key] = getattr(quota, key)
    return out


def _tier(tier: TierConfig) -> dict[str, Any]:
    # Only the keys meaningful for the kind: the loader rejects the others.
    keys = ["capacity", *sorted(TierConfig.KIND_KEYS[tier.kind])]
    out: dict[str, Any] = {"name": tier.name, "kind": tier.kind.value}
    for key in keys:
        value = getattr(tier, key)
        if value is not None:  # numa_node None means "no binding": omitted, not null
            out[key] = _size(value) if key in _SIZE_KEYS else value
    return out


def _size(n: int) -> int | str:
    for unit, factor in _UNITS:
        if n % factor == 0:
            return f"{n // factor}{unit}"
    return n
