"""Store configuration: the tier order, capacities and policy knobs, validated up front.

A config is a frozen value built from a plain mapping (parsed YAML, environment, flags) by
:meth:`StoreConfig.from_dict`; unknown keys, bad sizes and hostile paths raise
:class:`~kvfabric.errors.ConfigError` with the offending key in the message.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar

from kvfabric.errors import ConfigError
from kvfabric.store.codec import FORMATS
from kvfabric.tiers.base import TierKind

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
_UNITS = {
    "": 1,
    "b": 1,
    "k": KiB,
    "kb": 1000,
    "kib": KiB,
    "m": MiB,
    "mb": 1000**2,
    "mib": MiB,
    "g": GiB,
    "gb": 1000**3,
    "gib": GiB,
    "t": TiB,
    "tb": 1000**4,
    "tib": TiB,
}


def parse_size(value: int | str, what: str = "size") -> int:
    """``"4GiB"``, ``"512 MiB"``, ``"1.5g"`` or an int -> bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size, got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ConfigError(f"{what}: cannot parse size {value!r} (e.g. 4GiB, 512MiB)")
        size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ConfigError(f"{what}: must be positive, got {value!r}")
    return size


def format_size(n: float) -> str:
    """Bytes for people: ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@dataclass(frozen=True)
class TierConfig:
    """One tier. Keys not meaningful for a kind are rejected, not ignored."""

    kind: TierKind
    capacity: int
    name: str = ""
    page_size: int = 256 * KiB  # dram / cxl / device
    numa_node: int | None = None  # cxl (or a dram tier pinned to a socket)
    prefault: bool = False  # dram / cxl: touch all pages at start-up
    device: str = "cpu"  # device
    path: str = "ssd"  # ssd: directory, relative to the store's data_dir
    segment_bytes: int = 256 * MiB  # ssd
    writers: int = 1  # ssd
    fsync: bool = False  # ssd: fsync each record (power-loss durability, slower)
    format: str = "native"  # ssd: "fp8" keeps bf16/fp16/fp32 chunks quantized (store/codec.py)

    KIND_KEYS: ClassVar[dict[TierKind, set[str]]] = {
        TierKind.DRAM: {"page_size", "numa_node", "prefault"},
        TierKind.CXL: {"page_size", "numa_node", "prefault"},
        TierKind.DEVICE: {"page_size", "device"},
        TierKind.SSD: {"path", "segment_bytes", "writers", "fsync", "format"},
    }

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", self.kind.value)
        if not re.fullmatch(r"[a-z][a-z0-9_-]{0,31}", self.name):
            raise ConfigError(f"tier name {self.name!r}: lowercase letters, digits, - and _")
        if self.format not in FORMATS:
            raise ConfigError(
                f"{self.name}.format must be one of {list(FORMATS)}, got {self.format!r}"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TierConfig:
        data = dict(data)
        try:
            kind = TierKind(str(data.pop("kind", "")).lower())
        except ValueError:
            raise ConfigError(
                f"tier kind must be one of {[k.value for k in TierKind]}, got {data.get('kind')!r}"
            ) from None
        allowed = cls.KIND_KEYS[kind] | {"capacity", "name"}
        unknown = set(data) - allowed
        if unknown:
            raise ConfigError(
                f"{kind.value} tier: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}"
            )
        if "capacity" not in data:
            raise ConfigError(f"{kind.value} tier: 'capacity' is required")
        data["capacity"] = parse_size(data["capacity"], f"{kind.value}.capacity")
        for key in ("page_size", "segment_bytes"):
            if key in data:
                data[key] = parse_size(data[key], f"{kind.value}.{key}")
        for key in ("writers", "numa_node"):
            if key in data and (
                isinstance(data[key], bool) or not isinstance(data[key], int) or data[key] < 0
            ):
                raise ConfigError(f"{kind.value}.{key}: expected a non-negative integer")
        return cls(kind=kind, **data)


QUOTA_LIMITS = ("reservations", "namespaces")
ANY_TENANT = "*"


@dataclass(frozen=True)
class Quota:
    """What one tenant (a namespace ``tenant_salt``) may hold; None: no limit of that kind.

    ``tiers`` maps tier names (memory tiers and the SSD tier) to bytes (an int) or a share of
    the tier (a float in (0, 1]; ``"40%"`` in YAML): the tenant's objects there never take
    more, whoever put them (on SSD: its records, header pages included).
    ``reservations``: writes in flight at once (a reservation whose lease expired counts
    until its session ends). ``namespaces``: namespaces holding data at once.
    """

    tiers: Mapping[str, int | float] = field(default_factory=dict)
    reservations: int | None = None
    namespaces: int | None = None

    def __post_init__(self) -> None:
        for name in QUOTA_LIMITS:
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ConfigError(f"quota {name} must be a positive integer, got {value!r}")
        for tier, limit in self.tiers.items():
            if (
                isinstance(limit, bool)
                or not isinstance(limit, (int, float))
                or limit <= 0
                or (isinstance(limit, float) and limit > 1)
            ):
                raise ConfigError(
                    f"quota for tier {tier!r} must be a size or a share in (0, 100%], got {limit!r}"
                )

    @classmethod
    def from_dict(cls, data: Any, what: str) -> Quota:
        if isinstance(data, Quota):
            return data
        if not isinstance(data, Mapping):
            raise ConfigError(f"{what} must be a mapping of tier names, reservations, namespaces")
        tiers: dict[str, int | float] = {}
        limits: dict[str, Any] = {}
        for key, value in data.items():
            if key in QUOTA_LIMITS:
                limits[key] = value
            elif isinstance(value, str) and value.strip().endswith("%"):
                try:
                    tiers[str(key)] = float(value.strip()[:-1]) / 100
                except ValueError:
                    raise ConfigError(f"{what}.{key}: cannot parse {value!r}") from None
            else:
                tiers[str(key)] = parse_size(value, f"{what}.{key}")
        try:
            return cls(tiers=tiers, **limits)
        except ConfigError as exc:
            raise ConfigError(f"{what}: {exc}") from None

    def over(self, default: Quota | None) -> Quota:
        """This quota, with what it leaves unset taken from ``default``."""
        if default is None:
            return self
        return Quota(
            tiers={**default.tiers, **self.tiers},
            reservations=self.reservations
            if self.reservations is not None
            else default.reservations,
            namespaces=self.namespaces if self.namespaces is not None else default.namespaces,
        )

    def tier_bytes(self, tier: str, capacity: int) -> int | None:
        limit = self.tiers.get(tier)
        if limit is None:
            return None
        return int(limit * capacity) if isinstance(limit, float) else min(limit, capacity)


def default_tiers() -> tuple[TierConfig, ...]:
    """Embedded defaults: 1 GiB of DRAM in front of 8 GiB of SSD under the data dir."""
    return (TierConfig(TierKind.DRAM, 1 * GiB), TierConfig(TierKind.SSD, 8 * GiB))


@dataclass(frozen=True)
class StoreConfig:
    """The tiered store: tier order (fastest first) and policy."""

    data_dir: str = "./kvfabric-data"
    tiers: tuple[TierConfig, ...] = field(default_factory=default_tiers)
    high_watermark: float = 0.95  # start demoting above this fraction of a tier
    low_watermark: float = 0.85  # ... until this fraction
    promote_on_hit: bool = True
    reservation_timeout_s: float = 30.0  # a put not committed by then is aborted
    pin_timeout_s: float = 60.0  # a reader holding a pin longer loses it
    maintenance_interval_s: float = 0.25
    compact_dead_ratio: float = 0.5  # SSD segments with this share of dead bytes get compacted
    persist_on_close: bool = True  # write memory-resident objects to SSD when closing
    # share of a memory tier's capacity that free pages may keep resident (per arena); the
    # maintenance pass gives the rest of the free memory back to the OS
    free_memory_kept: float = 0.15
    # tenant (namespace tenant_salt) -> Quota; "*" applies to every tenant without an entry
    # of its own (field by field); namespaces without a tenant salt have no quota
    quotas: Mapping[str, Quota] = field(default_factory=dict)
    # start even when the memory tiers exceed physical RAM or an SSD tier the free disk
    # (kvfabric/preflight.py checks both before serving; this turns the refusal into a warning)
    allow_overcommit: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.data_dir, str):
            raise ConfigError(f"data_dir must be a path string, got {self.data_dir!r}")
        for name in (
            "high_watermark",
            "low_watermark",
            "reservation_timeout_s",
            "pin_timeout_s",
            "maintenance_interval_s",
            "compact_dead_ratio",
            "free_memory_kept",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{name} must be a number, got {value!r}")
        for name in ("promote_on_hit", "persist_on_close", "allow_overcommit"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not self.tiers:
            raise ConfigError("at least one tier is required")
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be unique, got {names}")
        if self.tiers[0].kind is TierKind.SSD:
            raise ConfigError("the first tier must be memory (dram, cxl or device), not ssd")
        for i, tier in enumerate(self.tiers):
            if tier.kind is TierKind.SSD and i != len(self.tiers) - 1:
                raise ConfigError("an ssd tier must be the last tier")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ConfigError("watermarks must satisfy 0 < low_watermark <= high_watermark <= 1")
        for name in ("reservation_timeout_s", "pin_timeout_s", "maintenance_interval_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if "\x00" in self.data_dir:
            raise ConfigError("data_dir contains a NUL byte")
        if not 0 <= self.free_memory_kept <= 1:
            raise ConfigError("free_memory_kept must be a share of the tier in [0, 1]")
        self._check_quotas()

    def _check_quotas(self) -> None:
        if not isinstance(self.quotas, Mapping):
            raise ConfigError("quotas must map tenant names to quotas")
        names = {t.name for t in self.tiers}
        for tenant, quota in self.quotas.items():
            if not isinstance(tenant, str) or not tenant or not isinstance(quota, Quota):
                raise ConfigError(f"quotas: {tenant!r} must be a tenant name mapped to a quota")
            unknown = set(quota.tiers) - names
            if unknown:
                raise ConfigError(
                    f"quotas.{tenant}: {sorted(unknown)} name no tier; tiers: {sorted(names)}"
                )

    def quota_for(self, tenant: str) -> Quota | None:
        """The quota of ``tenant`` (its own over the ``*`` one); None: unlimited."""
        if not tenant:
            return None
        own = self.quotas.get(tenant)
        default = self.quotas.get(ANY_TENANT)
        return default if own is None else own.over(default)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StoreConfig:
        data = dict(data)
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"store: unknown key(s) {sorted(unknown)}; allowed: {sorted(known)}")
        if "tiers" in data:
            if not isinstance(data["tiers"], (list, tuple)):
                raise ConfigError("store.tiers must be a list of tier mappings")
            tiers = []
            for entry in data["tiers"]:
                if isinstance(entry, dict):
                    tiers.append(TierConfig.from_dict(entry))
                elif isinstance(entry, TierConfig):
                    tiers.append(entry)
                else:
                    raise ConfigError(f"store.tiers entries must be mappings, got {entry!r}")
            data["tiers"] = tuple(tiers)
        if "quotas" in data:
            if not isinstance(data["quotas"], Mapping):
                raise ConfigError("store.quotas must map tenant names to quota mappings")
            data["quotas"] = {
                str(tenant): Quota.from_dict(quota, f"store.quotas.{tenant}")
                for tenant, quota in data["quotas"].items()
            }
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(f"store: {exc}") from None

    def with_data_dir(self, data_dir: str | Path) -> StoreConfig:
        return replace(self, data_dir=str(data_dir))
