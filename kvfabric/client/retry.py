"""Reconnect policy: small strategies behind one interface (after redis-py's retry/backoff)."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod


class Backoff(ABC):
    @abstractmethod
    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based)."""


class ExponentialBackoff(Backoff):
    """``base * 2**attempt`` capped at ``cap``, with full jitter so clients do not stampede."""

    def __init__(self, base: float = 0.02, cap: float = 1.0) -> None:
        self.base, self.cap = base, cap

    def delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.cap, self.base * (2**attempt)))


class NoBackoff(Backoff):
    def delay(self, attempt: int) -> float:
        return 0.0
