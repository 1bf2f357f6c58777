"""Build tier objects from their configs (the only place that knows every tier class)."""

from __future__ import annotations

from pathlib import Path

from kvfabric.store.config import TierConfig
from kvfabric.tiers.base import PagedTier, TierKind
from kvfabric.tiers.device import DeviceTier
from kvfabric.tiers.disk import DiskTier
from kvfabric.tiers.host import HostTier

AnyTier = PagedTier | DiskTier


def build_tier(config: TierConfig, data_dir: Path) -> AnyTier:
    """Create one tier; an SSD tier's directory is confined to ``data_dir``."""
    if config.kind in (TierKind.DRAM, TierKind.CXL):
        return HostTier(
            config.name,
            config.kind,
            config.capacity,
            config.page_size,
            numa_node=config.numa_node,
            prefault=config.prefault,
            huge_pages=config.huge_pages,
        )
    if config.kind is TierKind.DEVICE:
        return DeviceTier(config.name, config.capacity, config.page_size, device=config.device)
    return DiskTier(
        config.path,
        capacity_bytes=config.capacity,
        segment_bytes=config.segment_bytes,
        writers=config.writers,
        fsync=config.fsync,
        root=data_dir,
    )
