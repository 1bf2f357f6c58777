"""Store configuration parsing: sizes, tier rules, unknown keys."""

from __future__ import annotations

import pytest

from kvfabric.errors import ConfigError
from kvfabric.store.config import StoreConfig, TierConfig, parse_size
from kvfabric.tiers.base import TierKind


@pytest.mark.parametrize(
    "text,expected",
    [
        ("4GiB", 4 << 30),
        ("512 MiB", 512 << 20),
        ("1.5g", int(1.5 * (1 << 30))),
        (4096, 4096),
        ("10kb", 10000),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["lots", "-1G", "0", 0, True, "4 parsecs"])
def test_parse_size_rejects_garbage(bad: object) -> None:
    with pytest.raises(ConfigError):
        parse_size(bad)  # type: ignore[arg-type]


def test_tiers_from_dicts() -> None:
    config = StoreConfig.from_dict(
        {
            "data_dir": "/tmp/x",
            "tiers": [
                {"kind": "dram", "capacity": "64MiB", "page_size": "64KiB"},
                {"kind": "cxl", "capacity": "128MiB", "numa_node": 1},
                {"kind": "ssd", "capacity": "1GiB", "path": "ssd0", "writers": 2},
            ],
        }
    )
    assert [t.kind for t in config.tiers] == [TierKind.DRAM, TierKind.CXL, TierKind.SSD]
    assert config.tiers[0].page_size == 64 << 10
    assert config.tiers[1].name == "cxl" and config.tiers[1].numa_node == 1


@pytest.mark.parametrize(
    "tiers,message",
    [
        ([{"kind": "tape", "capacity": "1G"}], "kind: must be one of"),
        ([{"kind": "dram"}], r"tiers\[0\]\.capacity: required"),
        ([{"kind": "dram", "capacity": "1G", "path": "x"}], "unknown key"),
        ([{"kind": "ssd", "capacity": "1G"}], "first tier must be memory"),
        (
            [
                {"kind": "dram", "capacity": "1G"},
                {"kind": "ssd", "capacity": "1G"},
                {"kind": "cxl", "capacity": "1G"},
            ],
            "ssd tier must be the last",
        ),
        ([{"kind": "dram", "capacity": "1G"}, {"kind": "dram", "capacity": "1G"}], "unique"),
        ([{"kind": "dram", "capacity": "1G", "writers": 1}], "unknown key"),
        ([{"kind": "cxl", "capacity": "1G", "numa_node": -3}], "non-negative"),
        ([], "at least one tier"),
    ],
)
def test_bad_tier_configs(tiers: list[dict], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        StoreConfig.from_dict({"tiers": tiers})


def test_unknown_store_keys_and_bad_watermarks() -> None:
    with pytest.raises(ConfigError, match="unknown key"):
        StoreConfig.from_dict({"hig_watermark": 0.9})
    with pytest.raises(ConfigError, match="watermarks"):
        StoreConfig(high_watermark=0.5, low_watermark=0.8)
    with pytest.raises(ConfigError, match="name: must be lowercase"):
        TierConfig(TierKind.DRAM, 1 << 20, name="../evil")


def test_quotas_parse_sizes_shares_and_counts_and_merge_over_the_default() -> None:
    config = StoreConfig.from_dict(
        {
            "tiers": [{"kind": "dram", "capacity": "1GiB"}, {"kind": "ssd", "capacity": "4GiB"}],
            "quotas": {
                "*": {"dram": "25%", "reservations": 64, "namespaces": 8},
                "team-a": {"dram": "128MiB"},
            },
        }
    )
    own = config.quota_for("team-a")
    assert own is not None and own.tier_bytes("dram", 1 << 30) == 128 << 20
    assert (own.reservations, own.namespaces) == (64, 8)  # from "*"
    other = config.quota_for("team-b")
    assert other is not None and other.tier_bytes("dram", 1 << 30) == 256 << 20
    assert config.quota_for("") is None  # namespaces without a tenant salt: no quota
    assert StoreConfig().quota_for("team-a") is None and StoreConfig().free_memory_kept == 0.15


def test_an_ssd_quota_is_a_size_or_a_share_of_the_ssd_tier() -> None:
    """Regression: on the old code ``quotas.<tenant>.ssd`` was refused ("name no memory
    tier"): no tenant's SSD bytes could be bounded."""
    config = StoreConfig.from_dict(
        {
            "tiers": [{"kind": "dram", "capacity": "1GiB"}, {"kind": "ssd", "capacity": "4GiB"}],
            "quotas": {"*": {"ssd": "25%"}, "team-a": {"ssd": "512MiB", "dram": "10%"}},
        }
    )
    own, other = config.quota_for("team-a"), config.quota_for("team-b")
    assert own is not None and own.tier_bytes("ssd", 4 << 30) == 512 << 20
    assert own.tier_bytes("ssd", 256 << 20) == 256 << 20  # never more than the tier
    assert other is not None and other.tier_bytes("ssd", 4 << 30) == 1 << 30
    named = StoreConfig.from_dict(
        {  # the SSD tier by its configured name
            "tiers": [
                {"kind": "dram", "capacity": "1GiB"},
                {"kind": "ssd", "capacity": "4GiB", "name": "nvme"},
            ],
            "quotas": {"team-a": {"nvme": "1GiB"}},
        }
    )
    assert named.quota_for("team-a").tier_bytes("nvme", 4 << 30) == 1 << 30  # type: ignore


@pytest.mark.parametrize(
    "quotas,message",
    [
        ({"a": {"tape": "1GiB"}}, r"\['tape'\] name no tier; tiers: \['dram', 'ssd'\]"),
        ({"a": {"ssd": "0%"}}, "share"),
        ({"a": {"ssd": "150%"}}, "share"),
        ({"a": {"ssd": "-1GiB"}}, "cannot parse"),
        ({"a": {"ssd": True}}, "store.quotas.a.ssd: expected a size"),
        ({"a": {"dram": "150%"}}, "share"),
        ({"a": {"dram": "lots"}}, "cannot parse"),
        ({"a": {"reservations": 0}}, "positive integer"),
        ({"a": {"namespaces": "many"}}, "positive integer"),
        ({"a": "1GiB"}, "must be a mapping"),
        (["a"], "must map tenant names"),
    ],
)
def test_bad_quotas_are_refused_with_the_key(quotas: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        StoreConfig.from_dict(
            {
                "tiers": [
                    {"kind": "dram", "capacity": "1GiB"},
                    {"kind": "ssd", "capacity": "4GiB"},
                ],
                "quotas": quotas,
            }
        )


def test_free_memory_kept_is_a_share() -> None:
    with pytest.raises(ConfigError, match="free_memory_kept"):
        StoreConfig(free_memory_kept=1.5)


def test_allow_overcommit_is_a_bool_and_off_by_default() -> None:
    assert StoreConfig().allow_overcommit is False
    assert StoreConfig.from_dict({"allow_overcommit": True}).allow_overcommit is True
    with pytest.raises(ConfigError, match="allow_overcommit: must be true or false"):
        StoreConfig(allow_overcommit="yes")  # type: ignore[arg-type]
