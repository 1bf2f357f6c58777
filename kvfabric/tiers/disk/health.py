"""Write-fault state of the SSD tier: degraded or not, errors by errno, a rate-limited log.

A write the tier cannot complete (ENOSPC, EDQUOT, EIO, EROFS, EFBIG: any ``OSError`` while
creating a segment, writing a record or marking one DEAD) puts the tier in the *degraded*
state: it takes no new records (the owner evicts instead of demoting), what it holds stays
readable, and it tries to leave the state by itself no more often than every
``retry_interval_s`` (``DiskTier.probe``, called on the store's maintenance tick).

Every error is counted by errno name (``ENOSPC``...), read errors included (those refuse one
record but do not degrade the tier). The log gets at most one line per ``log_interval_s``
whatever the error rate, with the number of errors it did not report: a full disk under
load fails hundreds of writes a second, and one line per failure drowned the log.

Not thread-safe: DiskTier calls it under its lock.
"""

from __future__ import annotations

import errno
import logging
import time

log = logging.getLogger("kvfabric.tiers.disk")

DEFAULT_RETRY_INTERVAL_S = 1.0
DEFAULT_LOG_INTERVAL_S = 30.0


def errno_name(exc: BaseException) -> str:
    """``ENOSPC`` for an OSError with that errno; ``EUNKNOWN`` when it has none."""
    code = getattr(exc, "errno", None)
    return errno.errorcode.get(code, f"E{code}") if code else "EUNKNOWN"


class DiskHealth:
    """Degraded flag, error counts by errno and the rate-limited log of one disk tier."""

    def __init__(
        self,
        where: str,
        *,
        retry_interval_s: float = DEFAULT_RETRY_INTERVAL_S,
        log_interval_s: float = DEFAULT_LOG_INTERVAL_S,
    ) -> None:
        self.where = where
        self.retry_interval_s = retry_interval_s
        self.log_interval_s = log_interval_s
        self.reason: str | None = None  # errno name that degraded the tier; None: writable
        self.errors: dict[str, int] = {}
        self.need = 0  # bytes the failed write needed: what a probe must find room for
        self.retry_at = 0.0
        self._logged_at = -float("inf")
        self._unreported = 0

    @property
    def degraded(self) -> bool:
        return self.reason is not None

    def failed_write(self, exc: BaseException, what: str, need: int = 0) -> None:
        """A write failed: count it and (stay) degraded until a probe succeeds."""
        name = errno_name(exc)
        self.errors[name] = self.errors.get(name, 0) + 1
        if self.reason is None:
            self.retry_at = time.monotonic() + self.retry_interval_s
        self.reason = name
        self.need = max(self.need, need)
        self._log(
            f"disk tier {self.where} degraded: {what} failed ({exc}); no new SSD "
            f"records until writes succeed again"
        )

    def failed_read(self, exc: BaseException, what: str) -> None:
        name = errno_name(exc)
        self.errors[name] = self.errors.get(name, 0) + 1
        self._log(f"disk tier {self.where}: {what} failed ({exc})")

    def probe_due(self) -> bool:
        """Whether a degraded tier should try writing again now (and schedule the next try)."""
        now = time.monotonic()
        if self.reason is None or now < self.retry_at:
            return False
        self.retry_at = now + self.retry_interval_s
        return True

    def recovered(self) -> None:
        was, self.reason, self.need = self.reason, None, 0
        self._log(f"disk tier {self.where} writable again (was degraded by {was})")

    def _log(self, message: str) -> None:
        now = time.monotonic()
        if now - self._logged_at < self.log_interval_s:
            self._unreported += 1
            return
        if self._unreported:
            message += f" [{self._unreported} more disk errors since the last report]"
        self._logged_at, self._unreported = now, 0
        log.warning("%s", message)
