"""SSD tier of kvfabric: append-only, checksummed, 4 KiB-aligned record segments.

See ``tier`` for the DiskTier contract, ``records`` for the on-disk format and
``segments`` for file handling and path safety.
"""

from kvfabric.tiers.disk.records import ALIGN, MAX_META, MAX_PAYLOAD, RecordFieldError
from kvfabric.tiers.disk.tier import (
    DiskExtent,
    DiskTier,
    DiskTierStats,
    RecoveredRecord,
    StaleExtentError,
    TierDegradedError,
)

__all__ = [
    "ALIGN",
    "MAX_META",
    "MAX_PAYLOAD",
    "DiskExtent",
    "DiskTier",
    "DiskTierStats",
    "RecordFieldError",
    "RecoveredRecord",
    "StaleExtentError",
    "TierDegradedError",
]
