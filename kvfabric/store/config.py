"""Store configuration: the tier order, capacities and policy knobs, validated up front.

:class:`StoreConfig`, :class:`TierConfig` and :class:`Quota` are frozen configuration models
(:mod:`kvfabric.config_model`): built directly, by :meth:`StoreConfig.from_dict` from a plain
mapping (parsed YAML, environment, flags) or nested in the daemon's config, they validate the
same way, and unknown keys, bad sizes and hostile paths raise
:class:`~kvfabric.errors.ConfigError` naming the dotted key (``store.tiers[1].capacity: ...``).
A tier takes only the keys meaningful for its kind. Sizes accept the spellings of
:data:`kvfabric.config_types.ByteSize` (``4GiB``, ``512 MiB``, ``1.5g``, ints).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import field, replace
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import PlainValidator, field_validator, model_validator
from pydantic_core import ArgsKwargs

from kvfabric.config_model import KeyProblems, config_value, parse_config
from kvfabric.config_types import (
    ByteSize,
    Flag,
    GiB,
    KiB,
    MiB,
    NonNegativeInt,
    Number,
    PathText,
    Seconds,
    Share,
    Text,
    TiB,
    format_size,
    int_in,
    one_of,
    optional,
    parse_size,
    size_bytes,
)
from kvfabric.errors import ConfigError
from kvfabric.store.codec import FORMATS
from kvfabric.tiers.base import TierKind

__all__ = [
    "GiB",
    "KiB",
    "MiB",
    "Quota",
    "StoreConfig",
    "TiB",
    "TierConfig",
    "default_tiers",
    "format_size",
    "parse_size",
]


def _tier_kind(value: object) -> TierKind:
    if isinstance(value, TierKind):
        return value
    try:
        return TierKind(str(value).lower())
    except ValueError:
        raise ConfigError(f"must be one of {[k.value for k in TierKind]}, got {value!r}") from None


_TIER_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")


HUGE_PAGES = ("auto", "on", "off")


@config_value
class TierConfig:
    """One tier. Keys not meaningful for a kind are rejected, not ignored."""

    kind: Annotated[TierKind, PlainValidator(_tier_kind)]
    capacity: ByteSize
    name: Text = ""  # default: the kind
    page_size: ByteSize = 256 * KiB  # dram / cxl / device
    numa_node: Annotated[int | None, PlainValidator(optional(int_in(0)))] = None  # cxl (or dram)
    prefault: Flag = False  # dram / cxl: touch all pages at start-up
    # dram / cxl: back the arenas with reserved huge pages (vm.nr_hugepages): "auto" when
    # enough are free, "on" always (start-up fails without them), "off" never
    huge_pages: Annotated[str, PlainValidator(one_of(*HUGE_PAGES))] = "auto"
    device: Text = "cpu"  # device
    path: Text = "ssd"  # ssd: directory, relative to the store's data_dir
    segment_bytes: ByteSize = 256 * MiB  # ssd
    writers: NonNegativeInt = 1  # ssd
    fsync: Flag = False  # ssd: fsync each record (power-loss durability, slower)
    # ssd: "fp8" keeps bf16/fp16/fp32 chunks quantized (store/codec.py)
    format: Annotated[str, PlainValidator(one_of(*FORMATS))] = "native"

    KIND_KEYS: ClassVar[dict[TierKind, set[str]]] = {
        TierKind.DRAM: {"page_size", "numa_node", "prefault", "huge_pages"},
        TierKind.CXL: {"page_size", "numa_node", "prefault", "huge_pages"},
        TierKind.DEVICE: {"page_size", "device"},
        TierKind.SSD: {"path", "segment_bytes", "writers", "fsync", "format"},
    }

    @classmethod
    def config_keys(cls, data: Mapping[str, Any]) -> Collection[str]:
        """The keys a tier of ``data["kind"]`` takes (every field when the kind is not given
        there, as in ``TierConfig(TierKind.SSD, ...)``, or is unknown: ``kind`` says so)."""
        try:
            kind = _tier_kind(data["kind"])
        except (KeyError, ConfigError):
            return list(cls.__dataclass_fields__)
        return cls.KIND_KEYS[kind] | {"kind", "capacity", "name"}

    @model_validator(mode="after")
    def _named(self) -> TierConfig:
        if not self.name:
            object.__setattr__(self, "name", self.kind.value)
        if not _TIER_NAME.fullmatch(self.name):
            raise KeyProblems(
                [("name", f"must be lowercase letters, digits, - and _, got {self.name!r}")]
            )
        return self

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TierConfig:
        return parse_config(cls, data)


QUOTA_LIMITS = ("reservations", "namespaces")
ANY_TENANT = "*"


def _quota_limit(value: object) -> int | float:
    """Bytes (a size) or a share of the tier (a float in (0, 1], ``"40%"``)."""
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            value = float(value.strip()[:-1]) / 100
        except ValueError:
            raise ConfigError(f"cannot parse {value!r}") from None
        if not 0 < value <= 1:
            raise ConfigError(f"must be a size or a share in (0, 100%], got {value:.0%}")
        return value
    return size_bytes(value)


def _quota_share(value: object) -> int | float:
    """A direct ``Quota(tiers=...)`` value: bytes (an int) or a share (a float in (0, 1])."""
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ConfigError(f"must be a size or a share in (0, 100%], got {value!r}")
        return value
    return _quota_limit(value)


@config_value
class Quota:
    """What one tenant (a namespace ``tenant_salt``) may hold; None: no limit of that kind.

    ``tiers`` maps tier names (memory tiers and the SSD tier) to bytes (an int) or a share of
    the tier (a float in (0, 1]; ``"40%"`` in YAML): the tenant's objects there never take
    more, whoever put them (on SSD: its records, header pages included).
    ``reservations``: writes in flight at once (a reservation whose lease expired counts
    until its session ends). ``namespaces``: namespaces holding data at once.

    In a config file a quota is one flat mapping: tier names, ``reservations``,
    ``namespaces`` (``{dram: 25%, reservations: 64}``).
    """

    tiers: Mapping[str, Annotated[int | float, PlainValidator(_quota_share)]] = field(
        default_factory=dict
    )
    reservations: Annotated[int | None, PlainValidator(optional(int_in(1)))] = None
    namespaces: Annotated[int | None, PlainValidator(optional(int_in(1)))] = None

    @classmethod
    def config_keys(cls, data: Mapping[str, Any]) -> Collection[str]:
        return list(data)  # the flat form: every key not a limit is a tier name

    @model_validator(mode="before")
    @classmethod
    def _flat(cls, data: Any) -> Any:
        if isinstance(data, ArgsKwargs):
            return data  # Quota(tiers=..., ...): the fields as they are
        if not isinstance(data, Mapping):
            raise ConfigError("must be a mapping of tier names, reservations, namespaces")
        tiers: dict[str, int | float] = {}
        problems: list[tuple[str, str]] = []
        for key, value in data.items():
            if key in QUOTA_LIMITS:
                continue
            try:
                tiers[str(key)] = _quota_limit(value)
            except ConfigError as exc:
                problems.append((str(key), str(exc)))
        if problems:
            raise KeyProblems(problems)
        return {"tiers": tiers, **{k: data[k] for k in QUOTA_LIMITS if k in data}}

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


@config_value
class StoreConfig:
    """The tiered store: tier order (fastest first) and policy."""

    data_dir: PathText = "./kvfabric-data"
    tiers: tuple[TierConfig, ...] = field(default_factory=default_tiers)
    high_watermark: Number = 0.95  # start demoting above this fraction of a tier
    low_watermark: Number = 0.85  # ... until this fraction
    promote_on_hit: Flag = True
    reservation_timeout_s: Seconds = 30.0  # a put not committed by then is aborted
    pin_timeout_s: Seconds = 60.0  # a reader holding a pin longer loses it
    maintenance_interval_s: Seconds = 0.25
    compact_dead_ratio: Number = 0.5  # SSD segments with this share of dead bytes get compacted
    persist_on_close: Flag = True  # write memory-resident objects to SSD when closing
    # share of a memory tier's capacity that free pages may keep resident (per arena); the
    # maintenance pass gives the rest of the free memory back to the OS
    free_memory_kept: Share = 0.15
    # tenant (namespace tenant_salt) -> Quota; "*" applies to every tenant without an entry
    # of its own (field by field); namespaces without a tenant salt have no quota
    quotas: Mapping[str, Quota] = field(default_factory=dict)
    # start even when the memory tiers exceed physical RAM or an SSD tier the free disk
    # (kvfabric/preflight.py checks both before serving; this turns the refusal into a warning)
    allow_overcommit: Flag = False

    @field_validator("quotas", mode="before")
    @classmethod
    def _quota_map(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            raise ConfigError("must map tenant names to quotas")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> StoreConfig:
        problems: list[tuple[str, str]] = []
        names = [t.name for t in self.tiers]
        if not self.tiers:
            problems.append(("tiers", "at least one tier is required"))
        elif len(set(names)) != len(names):
            problems.append(("tiers", f"tier names must be unique, got {names}"))
        elif self.tiers[0].kind is TierKind.SSD:
            problems.append(
                ("tiers", "the first tier must be memory (dram, cxl or device), not ssd")
            )
        elif any(t.kind is TierKind.SSD for t in self.tiers[:-1]):
            problems.append(("tiers", "an ssd tier must be the last tier"))
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            problems.append(
                (
                    "low_watermark",
                    "watermarks must satisfy 0 < low_watermark <= high_watermark <= 1",
                )
            )
        for tenant, quota in self.quotas.items():
            unknown = set(quota.tiers) - set(names)
            if unknown:
                problems.append(
                    (f"quotas.{tenant}", f"{sorted(unknown)} name no tier; tiers: {sorted(names)}")
                )
        if problems:
            raise KeyProblems(problems)
        return self

    def quota_for(self, tenant: str) -> Quota | None:
        """The quota of ``tenant`` (its own over the ``*`` one); None: unlimited."""
        if not tenant:
            return None
        own = self.quotas.get(tenant)
        default = self.quotas.get(ANY_TENANT)
        return default if own is None else own.over(default)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StoreConfig:
        """``data`` (the ``store`` section of a config) validated; keys named ``store.*``."""
        return parse_config(cls, data, "store")

    def with_data_dir(self, data_dir: str | Path) -> StoreConfig:
        return replace(self, data_dir=str(data_dir))
