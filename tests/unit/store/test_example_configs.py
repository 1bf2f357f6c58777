"""The example configs in configs/ stay valid as the code changes."""

from __future__ import annotations

from pathlib import Path

import yaml

from kvfabric.store import StoreConfig
from kvfabric.tiers.base import TierKind

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def test_store_tiers_example_parses() -> None:
    raw = yaml.safe_load((CONFIGS / "store-tiers.yaml").read_text())
    config = StoreConfig.from_dict(raw["store"])
    assert [t.kind for t in config.tiers] == [TierKind.DRAM, TierKind.CXL, TierKind.SSD]
    assert config.tiers[2].capacity == 1 << 40
