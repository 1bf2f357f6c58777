"""Configuration value types: every spelling of a size, and what each type refuses."""

from __future__ import annotations

import pytest

from kvfabric.config_types import GiB, KiB, MiB, TiB, format_size, parse_size
from kvfabric.errors import ConfigError


@pytest.mark.parametrize(
    "given, expected",
    [
        (4096, 4096),
        ("4096", 4096),
        ("64GiB", 64 * GiB),
        ("512 MiB", 512 * MiB),
        (" 1.5g ", int(1.5 * GiB)),
        ("10kb", 10_000),
        ("10KB", 10_000),
        ("8k", 8 * KiB),
        ("2 TiB", 2 * TiB),
        ("3tb", 3 * 1000**4),
        ("7b", 7),
        (2048.0, 2048),  # a YAML float: bytes, as it always was
    ],
)
def test_sizes_take_ints_and_decimal_or_binary_units(given: int | str, expected: int) -> None:
    assert parse_size(given) == expected


@pytest.mark.parametrize(
    "bad, message",
    [
        ("lots", "cannot parse size"),
        ("4 parsecs", "cannot parse size"),
        ("-1G", "cannot parse size"),
        ("0", "must be positive"),
        (0, "must be positive"),
        (True, "expected a size"),
        (None, "expected a size"),
    ],
)
def test_sizes_refuse_garbage_naming_the_key(bad: object, message: str) -> None:
    with pytest.raises(ConfigError, match=f"^tier.capacity: {message}"):
        parse_size(bad, "tier.capacity")  # type: ignore[arg-type]


def test_format_size_is_for_people() -> None:
    assert (format_size(512), format_size(1536), format_size(3 * TiB)) == (
        "512 B",
        "1.5 KiB",
        "3.0 TiB",
    )
