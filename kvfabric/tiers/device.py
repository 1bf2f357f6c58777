"""Device tier: a pool of accelerator memory held as one torch ``uint8`` tensor, paged.

Engines on the node reach it through CUDA IPC (exported by the daemon); the store moves
objects between it and host tiers with ``Tensor.copy_``. On a CPU-only machine the device is
``cpu`` and exactly the same code runs.
"""

from __future__ import annotations

from typing import Any

from kvfabric.tiers.base import PagedTier, Pool, TierKind, View


class DeviceTier(PagedTier):
    """``capacity_bytes`` of memory on ``device`` (``"cpu"``, ``"cuda:0"``, ...)."""

    def __init__(
        self, name: str, capacity_bytes: int, page_size: int, *, device: str = "cpu"
    ) -> None:
        import torch  # the only tier that needs torch

        size = capacity_bytes - capacity_bytes % page_size
        super().__init__(name, TierKind.DEVICE, size, page_size)
        self.device = torch.device(device)
        self._pool = torch.empty(size, dtype=torch.uint8, device=self.device)

    def add_pool(self, tenant: str, capacity_bytes: int) -> None:
        raise ValueError("device memory is not shared with clients: it has one pool")

    def _viewer(self, pool: Pool) -> View:
        return self._view

    def _view(self, page_id: int, start: int, end: int) -> Any:
        base = page_id * self.page_size
        return self._pool[base + start : base + end]

    def close(self) -> None:
        self._pool = None  # type: ignore[assignment]
